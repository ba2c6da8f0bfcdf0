"""Deployment: what runs where (``plan``), and the shells that run it: ``zserve up``'s supervisor, supervisord's
configuration, Kubernetes manifests and pod entry points, worker hosts, ``zserve status`` and the quickstart
config. Above every other room: it names the broker, workers and frontends by module name only (the processes it
starts), and imports none of them."""
