"""``zserve k8s -c supervisor.toml``: Kubernetes manifests for a deployment, rendered from the one config.

One pod per process `zserve up` would start, each joining the broker over CURVE tcp as a worker host does:

- a ConfigMap with the deployment as the pods see it (tcp endpoints, key paths under /var/run/zserve), as
  TOML for people and ``zserve child``, and as the JSON each process takes;
- the broker: a Deployment of one replica with ``strategy: Recreate`` (two brokers would split the workers),
  ``zserve child ... broker``, and a Service for its client, work and out ports;
- per model, a Deployment of engines (replicas = ``engines``; ``nvidia.com/gpu`` from ``devices``, CPU
  requests from ``threads``) and, for a model with a preprocess stage, one of stages; each worker is named
  ``engine-MODEL@POD`` (pod names are unique; pids are not, every container's process is pid 1);
- the frontends (gunicorn) as a Deployment and a Service; their ZeroMQ clients connect over CURVE tcp;
- CURVE keys from one Secret (rendered as references; ``keys_command`` says how to create it);
- probes: the broker's ports, the frontends' ``/readyz`` and ``/healthz``, and a worker's registration
  (the file ``zserve/workers/runtime.py`` keeps while the broker knows it);
- PodDisruptionBudgets, ``terminationGracePeriodSeconds`` as `zserve up` and supervisord allow each role;
- autoscaling: HPAs on CPU for the frontends and each model's stages; for each model's engines a KEDA
  ScaledObject whose Prometheus trigger reads the broker's queue depth and in-flight items for that model
  (docs/kubernetes.md says why KEDA and not an HPA on an external metric).

``render`` is pure (a plan in, manifests out: dicts, in apply order); reading the file, importing the
handlers and writing YAML is the command's job.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from zserve.config import Config, ConfigError, Endpoints, ModelConfig, to_toml
from zserve.deploy.plan import ChildSpec, Deployment, plan

CONFIG_DIR = "/etc/zserve"
CONFIG_PATH = f"{CONFIG_DIR}/supervisor.toml"
RUN_DIR = "/tmp/zserve"  # an emptyDir: the root filesystem is read-only
KEYS_DIR = "/var/run/zserve/keys"  # this pod's own key pair and the broker's public key
AUTHORIZED_DIR = "/var/run/zserve/authorized"  # the broker's: the public keys it admits
API_KEYS_DIR = "/var/run/zserve/api-keys"
WORKER_STATE_DIR = "/tmp/zserve-worker"  # zserve/workers/runtime.py: `registered` while registered, `alive` touched
MODELS_DIR = "/models"  # where a models PVC is mounted (--models-pvc)
PORTS = {"client": 5555, "work": 5556, "out": 5557}
USER_ID = 10001  # the Containerfile's user
# How long a worker's link thread may go without a turn before its liveness probe fails: it loops at
# least every heartbeat interval, so this is only reached by a process that is stuck for good.
WORKER_STUCK_S = 60


@dataclass(frozen=True)
class RenderOptions:
    image: str = "zserve:latest"
    name: str = "zserve"  # prefix of every object's name, and the `app.kubernetes.io/instance` label
    namespace: str = ""  # "" = whatever namespace kubectl applies to
    prometheus: str = "http://prometheus-server.monitoring.svc:80"  # KEDA's trigger queries it
    max_engines_factor: int = 4  # KEDA may scale a model's engines up to engines x this
    max_frontends: int = 8  # the frontends' HPA ceiling
    models_pvc: str = ""  # a PersistentVolumeClaim mounted read-only at /models in engines, stages, frontends
    keys_secret: str = ""  # "" = NAME-keys
    api_keys_secret: str = ""  # "" = NAME-api-keys (only with [frontends] api_keys_file)


def dns_label(text: str) -> str:
    """``text`` as a Kubernetes object name part (RFC 1123: lower-case alphanumerics and '-')."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if not label:
        raise ConfigError(f"{text!r} gives no usable Kubernetes name")
    return label


def _port(endpoint: str, default: int) -> int:
    return int(endpoint.rsplit(":", 1)[1]) if endpoint else default


def pod_config(config: Config, opts: RenderOptions) -> Config:
    """The deployment as its pods see it: the broker binds tcp on every address of its pod (CURVE), keys and
    the API key file are mounted Secrets, the run dir is the pods' emptyDir, the frontends bind 0.0.0.0."""
    b, f = config.broker, config.frontends
    if b.insecure and not b.insecure_any_host:
        raise ConfigError("broker.insecure: plain tcp between pods needs insecure_any_host = true as well (or CURVE)")
    ports = {k: _port(e, PORTS[k]) for k, e in zip(PORTS, b.remote_endpoints(), strict=True)}
    curve = {} if b.insecure else {"curve_key": f"{KEYS_DIR}/broker.key_secret", "authorized_keys_dir": AUTHORIZED_DIR}
    broker = msgspec.structs.replace(b, **{f"{k}_endpoint": f"tcp://0.0.0.0:{p}" for k, p in ports.items()}, **curve)
    api_keys = f"{API_KEYS_DIR}/api_keys" if f.api_keys_file else ""
    frontends = msgspec.structs.replace(f, host="0.0.0.0", api_keys_file=api_keys)
    supervisor = msgspec.structs.replace(config.supervisor, run_dir=RUN_DIR)
    return msgspec.structs.replace(config, supervisor=supervisor, broker=broker, frontends=frontends)


def keys_command(opts: RenderOptions) -> str:
    """The shell commands that create the CURVE key Secret the manifests refer to."""
    secret = opts.keys_secret or f"{opts.name}-keys"
    ns = f" -n {opts.namespace}" if opts.namespace else ""
    return (
        "zserve keys generate keys --name broker && zserve keys generate keys --name worker && "
        f"zserve keys generate keys --name frontend && kubectl{ns} create secret generic {secret} --from-file=keys/"
    )


class _Renderer:
    def __init__(self, deployment: Deployment, opts: RenderOptions) -> None:
        self.plan = deployment
        self.config = deployment.config
        self.opts = opts
        self.name = dns_label(opts.name)
        self.broker_host = f"{self.name}-broker"
        self.secure = not self.config.broker.insecure
        self.keys_secret = opts.keys_secret or f"{self.name}-keys"

    # ---- small pieces ----

    def meta(self, name: str, component: str, model: str = "") -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "labels": self.labels(component, model)}
        if self.opts.namespace:
            meta["namespace"] = self.opts.namespace
        return meta

    def labels(self, component: str, model: str = "") -> dict[str, str]:
        labels = {
            "app.kubernetes.io/name": "zserve",
            "app.kubernetes.io/instance": self.name,
            "app.kubernetes.io/component": component,
        }
        if model:
            labels["zserve.dev/model"] = model
        return labels

    def configmap_env(self, var: str, key: str) -> dict[str, Any]:
        ref = {"name": f"{self.name}-config", "key": key}
        return {"name": var, "valueFrom": {"configMapKeyRef": ref}}

    def key_volume(self, own: str) -> dict[str, Any]:
        """This pod's key pair (``own``) and the broker's public key, from the keys Secret."""
        items = [{"key": f"{own}.key_secret", "path": f"{own}.key_secret"}]
        if own != "broker":
            items.append({"key": "broker.key", "path": "broker.key"})
        return {"name": "keys", "secret": {"secretName": self.keys_secret, "items": items, "defaultMode": 0o440}}

    def pod(self, container: dict[str, Any], volumes: list[dict[str, Any]], grace_s: float) -> dict[str, Any]:
        container["securityContext"] = {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        container.setdefault("volumeMounts", []).insert(0, {"name": "tmp", "mountPath": "/tmp"})
        if self.opts.models_pvc and container["name"] != "broker":
            container["volumeMounts"].append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
            volumes = [
                *volumes,
                {"name": "models", "persistentVolumeClaim": {"claimName": self.opts.models_pvc, "readOnly": True}},
            ]
        return {
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": USER_ID,
                "runAsGroup": USER_ID,
                "fsGroup": USER_ID,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "terminationGracePeriodSeconds": max(1, round(grace_s)),
            "enableServiceLinks": False,  # no FOO_SERVICE_HOST variables for every Service in the namespace
            "containers": [container],
            "volumes": [{"name": "tmp", "emptyDir": {}}, *volumes],
        }

    def deployment(
        self, name: str, component: str, replicas: int, pod: dict[str, Any], model: str = "", recreate: bool = False
    ) -> dict[str, Any]:
        labels = self.labels(component, model)
        strategy = (
            {"type": "Recreate"}
            if recreate
            else {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
        )
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": self.meta(name, component, model),
            "spec": {
                "replicas": replicas,
                "strategy": strategy,
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": pod},
            },
        }

    def service(self, name: str, component: str, ports: dict[str, int]) -> dict[str, Any]:
        """A Service for the pods of ``component``, each port named as its container's."""
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self.meta(name, component),
            "spec": {
                "selector": self.labels(component),
                "ports": [{"name": n, "port": p, "targetPort": n} for n, p in ports.items()],
            },
        }

    def pdb(self, name: str, component: str, model: str = "") -> dict[str, Any]:
        return {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": self.meta(name, component, model),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": self.labels(component, model)}},
        }

    # ---- objects ----

    def configmap(self, config_toml: str) -> dict[str, Any]:
        settings = self.plan.frontend_settings()
        settings.api_keys_file = self.config.frontends.api_keys_file  # the pod's path, not resolved here
        data = {
            "supervisor.toml": config_toml,
            "config.json": msgspec.json.encode(self.config).decode(),
            "frontend.json": msgspec.json.encode(settings).decode(),
        }
        for m in self.config.models:
            data[f"model.{m.name}.json"] = msgspec.json.encode(m).decode()
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": self.meta(f"{self.name}-config", "config"),
            "data": data,
        }

    def broker(self, child: ChildSpec) -> list[dict[str, Any]]:
        """``zserve child`` execs the broker from the mounted config: it creates the run dir and holds its lock."""
        # the broker's own argv is built in the pod, from CONFIG_PATH, by the same plan
        mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
        volumes: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": f"{self.name}-config"}}]
        if self.secure:
            mounts += [
                {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True},
                {"name": "authorized", "mountPath": AUTHORIZED_DIR, "readOnly": True},
            ]
            authorized = [{"key": f"{n}.key", "path": f"{n}.key"} for n in ("worker", "frontend")]
            volumes += [
                self.key_volume("broker"),
                {"name": "authorized", "secret": {"secretName": self.keys_secret, "items": authorized}},
            ]
        ports = self.broker_ports()
        tcp = {"tcpSocket": {"port": "work"}, "periodSeconds": 5}
        container = {
            "name": "broker",
            "image": self.opts.image,
            "args": ["child", "-c", CONFIG_PATH, "broker"],
            # SIGTERM means a new broker pod replaces this one: hand the queue back to the clients, no refusals
            "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "ZSERVE_BROKER_STOP", "value": "handover"}],
            "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
            "resources": {"requests": {"cpu": "1", "memory": "512Mi"}},  # one poll loop: one core
            "readinessProbe": tcp,
            "livenessProbe": {**tcp, "failureThreshold": 6},
            "volumeMounts": mounts,
        }
        pod = self.pod(container, volumes, int(child.stop_timeout_s))
        name = f"{self.name}-broker"
        return [self.deployment(name, "broker", 1, pod, recreate=True), self.service(name, "broker", ports)]

    def broker_ports(self) -> dict[str, int]:
        return {k: _port(e, PORTS[k]) for k, e in zip(PORTS, self.config.broker.remote_endpoints(), strict=True)}

    def worker_container(self, child: ChildSpec, model: ModelConfig, role: str) -> dict[str, Any]:
        """A worker's command is the one `zserve up` runs (the plan's), with its name made unique per pod and
        the JSON of its model read from the ConfigMap."""
        argv = ["python", *child.argv[1:]]  # the image's python, not this machine's
        argv[argv.index("--name") + 1] = f"{child.name.rsplit('-', 1)[0]}@$(POD_NAME)"
        argv[argv.index("--model-json") + 1] = "$(ZSERVE_MODEL_JSON)"
        env: dict[str, str] = {
            "PYTHONUNBUFFERED": "1",
            "HOME": "/tmp",
            "ZSERVE_WORKER_STATE_DIR": WORKER_STATE_DIR,
            **child.env,
        }
        # Inside a pod the device plugin has already chosen the GPUs: they are numbered from 0, all of them ours.
        if role == "engine":
            env.pop("CUDA_VISIBLE_DEVICES", None)
        resources: dict[str, Any] = {"requests": {"cpu": str(model.threads)}}
        gpus = self.gpus_per_engine(model) if role == "engine" else 0
        if gpus:
            resources["limits"] = {"nvidia.com/gpu": str(gpus)}
        registered = {"exec": {"command": ["test", "-e", f"{WORKER_STATE_DIR}/registered"]}, "periodSeconds": 2}
        alive_file = f"{WORKER_STATE_DIR}/alive"
        alive = f"import os,sys,time; sys.exit(time.time() - os.stat('{alive_file}').st_mtime > {WORKER_STUCK_S})"
        startup_s = self.config.supervisor.startup_timeout_s
        return {
            "name": role,
            "image": self.opts.image,
            "command": argv[:3],
            "args": argv[3:],
            "env": [
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                self.configmap_env("ZSERVE_MODEL_JSON", f"model.{model.name}.json"),
                *({"name": k, "value": v} for k, v in sorted(env.items())),
            ],
            "resources": resources,
            # Loading weights may take long: liveness starts once the worker first registered.
            "startupProbe": {**registered, "failureThreshold": max(1, int(startup_s // 2))},
            "readinessProbe": registered,
            "livenessProbe": {"exec": {"command": ["python", "-c", alive]}, "periodSeconds": 10},
            "volumeMounts": [{"name": "keys", "mountPath": KEYS_DIR, "readOnly": True}] if self.secure else [],
        }

    def gpus_per_engine(self, model: ModelConfig) -> int:
        kinds = {d.split(":")[0] for d in model.devices}
        if len(kinds) > 1:
            raise ConfigError(
                f"models[{model.name}].devices: mixes cpu and cuda; Kubernetes gives all of one "
                "model's engine pods the same resources (use two models)"
            )
        if "cuda" not in kinds:
            return 0
        return max(len(d.split(":", 1)[1].split(",")) for d in model.devices)

    def workers(self, model: ModelConfig, role: str, child: ChildSpec, replicas: int) -> list[dict[str, Any]]:
        component = "engine" if role == "engine" else "stage"
        name = f"{self.name}-{component}-{dns_label(model.name)}"
        container = self.worker_container(child, model, component)
        volumes = [self.key_volume("worker")] if self.secure else []
        pod = self.pod(container, volumes, int(child.stop_timeout_s))
        if role == "engine" and model.engines_per_device and model.engines_per_device > 1:
            # Kubernetes hands out whole GPUs; several engines per GPU need the device plugin's time-slicing.
            pod_meta = {"annotations": {"zserve.dev/engines-per-device": str(model.engines_per_device)}}
        else:
            pod_meta = {}
        deployment = self.deployment(name, component, replicas, pod, model.name)
        deployment["spec"]["template"]["metadata"].update(pod_meta)
        out = [deployment, self.pdb(name, component, model.name)]
        if role == "engine":
            out.append(self.scaled_object(name, model))
        else:  # a stage is CPU work alone: CPU utilisation measures it
            out.append(self.cpu_hpa(name, component, replicas, replicas * self.opts.max_engines_factor, model.name))
        return out

    def cpu_hpa(self, name: str, component: str, least: int, most: int, model: str = "") -> dict[str, Any]:
        """An HPA on the pods' CPU use against their requests (70%)."""
        target = {"type": "Utilization", "averageUtilization": 70}
        return {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": self.meta(name, component, model),
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                "minReplicas": least,
                "maxReplicas": most,
                "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": target}}],
            },
        }

    def scaled_object(self, deployment: str, model: ModelConfig) -> dict[str, Any]:
        """KEDA: engines = ceil((queued + in-flight items) / what one engine holds at full credit). Queue depth
        alone would scale a busy model with an empty queue down to its minimum; counting what engines hold
        keeps the engines that are working. ``max`` over the frontends: each reports the same broker figure."""
        per_engine = model.max_batch_size * model.credits
        m = model.name
        query = f'max(zserve_queue_depth{{model="{m}"}}) + max(zserve_in_flight{{model="{m}"}})'
        return {
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "ScaledObject",
            "metadata": self.meta(deployment, "engine", m),
            "spec": {
                "scaleTargetRef": {"name": deployment},
                "minReplicaCount": model.engines,
                "maxReplicaCount": model.engines * self.opts.max_engines_factor,
                "pollingInterval": 15,
                # scaling down costs nothing but a reload later (a worker told to stop hands its work back),
                # but a model's weights take long to load: keep engines for a while
                "cooldownPeriod": 300,
                "triggers": [
                    {
                        "type": "prometheus",
                        "metricType": "AverageValue",
                        "metadata": {
                            "serverAddress": self.opts.prometheus,
                            "query": query,
                            "threshold": str(per_engine),
                            "activationThreshold": "0",
                        },
                    }
                ],
            },
        }

    def frontend(self, child: ChildSpec) -> list[dict[str, Any]]:
        f = self.config.frontends
        argv = list(child.argv[3:])  # gunicorn's arguments (after `python -m gunicorn`)
        keys = ["--curve-key", f"{KEYS_DIR}/frontend.key_secret", "--broker-key", f"{KEYS_DIR}/broker.key"]
        command = ["python", "-m", "zserve.deploy.k8s_pod", "frontend", *(keys if self.secure else []), "--"]
        env = [
            self.configmap_env("ZSERVE_FRONTEND", "frontend.json"),
            {"name": "PROMETHEUS_MULTIPROC_DIR", "value": f"{RUN_DIR}/metrics"},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "HOME", "value": "/tmp"},
        ]
        mounts, volumes = [], []
        if self.secure:
            mounts.append({"name": "keys", "mountPath": KEYS_DIR, "readOnly": True})
            volumes.append(self.key_volume("frontend"))
        if f.api_keys_file:
            secret = self.opts.api_keys_secret or f"{self.name}-api-keys"
            mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
            volumes.append({"name": "api-keys", "secret": {"secretName": secret}})
        if f.auth_health:  # the probes cannot send a key: they only check that gunicorn accepts
            ready: dict[str, Any] = {"tcpSocket": {"port": "http"}}
            live: dict[str, Any] = {"tcpSocket": {"port": "http"}}
        else:
            ready = {"httpGet": {"path": "/readyz", "port": "http"}}
            live = {"httpGet": {"path": "/healthz", "port": "http"}}
        container = {
            "name": "frontend",
            "image": self.opts.image,
            "command": command,
            "args": argv,
            "env": env,
            "ports": [{"name": "http", "containerPort": f.port}],
            "resources": {"requests": {"cpu": str(f.workers)}},
            "readinessProbe": {**ready, "periodSeconds": 2},
            "livenessProbe": {**live, "periodSeconds": 10, "failureThreshold": 3},
            "volumeMounts": mounts,
        }
        pod = self.pod(container, volumes, int(child.stop_timeout_s))
        name = f"{self.name}-frontend"
        service = self.service(name, "frontend", {"http": f.port})
        hpa = self.cpu_hpa(name, "frontend", 1, max(1, self.opts.max_frontends))
        deployment = self.deployment(name, "frontend", 1, pod)
        # Prometheus' common scrape annotations: KEDA's queries read the broker's figures from /metrics here
        scrape = {"prometheus.io/scrape": "true", "prometheus.io/port": str(f.port), "prometheus.io/path": "/metrics"}
        deployment["spec"]["template"]["metadata"]["annotations"] = scrape
        return [deployment, service, self.pdb(name, "frontend"), hpa]


def render(deployment: Deployment, opts: RenderOptions) -> list[dict[str, Any]]:
    """The manifests, in apply order, for ``deployment``, which must be planned from ``pod_config(config,
    opts)`` and ``CONFIG_PATH`` (``pod_plan`` does both)."""
    r = _Renderer(deployment, opts)
    broker_child = deployment.broker()
    config_toml = to_toml(deployment.config)
    # Every other process reaches the broker through its Service; workers authenticate with the workers' key.
    keys = ("--curve-key", f"{KEYS_DIR}/worker.key_secret", "--broker-key", f"{KEYS_DIR}/broker.key")
    pods = replace(
        deployment,
        endpoints=Endpoints(*(f"tcp://{r.broker_host}:{p}" for p in r.broker_ports().values())),
        worker_args=keys if r.secure else (),
    )
    r.plan = pods
    out = [r.configmap(config_toml), *r.broker(broker_child)]
    for model in pods.config.models:
        out += r.workers(model, "engine", pods.engine(model, 0), model.engines)
        if model.name in pods.staged:
            out += r.workers(model, "preprocess", pods.stage(model, 0), model.preprocess_workers or 1)
    out += r.frontend(pods.frontend())
    return out


def pod_plan(config: Config, opts: RenderOptions) -> Deployment:
    """The plan for the pods' view of ``config``. Imports every handler class (constructors only), as `zserve up`
    does, so a broken one fails here."""
    return plan(pod_config(config, opts), CONFIG_PATH)


def header(opts: RenderOptions) -> str:
    return (
        "# Rendered by `zserve k8s`; render again after changing the models or the number of engines.\n"
        f"# Before applying, create the CURVE keys Secret:\n#   {keys_command(opts)}\n"
        f"# Apply: kubectl apply -f DIR/ (docs/kubernetes.md; the image {shlex.quote(opts.image)}: the Containerfile)\n"
    )
