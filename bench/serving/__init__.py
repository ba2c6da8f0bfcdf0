"""zserve against a naive server, the peers (mosec, service-streamer) and the model's own limit:
``python -m bench.serving`` (bench/README.md)."""
