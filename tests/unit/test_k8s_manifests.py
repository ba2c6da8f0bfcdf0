"""`zserve k8s`: the manifests rendered from supervisor.toml, checked against the Kubernetes API schemas of a
current release (kubernetes-validate, offline, strict: an unknown field fails) for a config with every kind of
model, and for what each object must say (replicas, GPUs, CPU, probes, grace periods, keys, autoscaling)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cluster import subprocess_env

from zserve.config import ConfigError, parse_config
from zserve.deploy.k8s import RenderOptions, pod_plan, render

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install kubernetes-validate)"
)
K8S_VERSION = "1.37.0"  # the newest release kubernetes-validate 1.37 ships schemas for

EVERY_KIND = """
[supervisor]
shutdown_timeout_s = 45

[broker]
drain_timeout_s = 12

[frontends]
workers = 2
port = 8080
graceful_timeout_s = 7
api_keys_file = "keys.txt"

[[models]]
name = "echo"
handler = "zserve.models.echo:Echo"
engines = 2

[[models]]
name = "mini_LM.v2"
handler = "zserve.models.embedding:SentenceEmbedding"
threads = 3
preprocess_workers = 2
devices = ["cuda:0", "cuda:1"]
engines_per_device = 2

[[models]]
name = "classifier"
handler = "zserve.models.classification:SequenceClassification"
[models.options]
path = "/models/clf"

[[models]]
name = "reranker"
handler = "zserve.models.rerank:CrossEncoderRerank"
[models.options]
path = "/models/rerank"

[[models]]
name = "vit"
handler = "zserve.models.image_classification:ImageClassification"
[models.options]
path = "/models/vit"

[[models]]
name = "lm"
handler = "zserve.models.causal_lm:CausalLM"
threads = 4
devices = ["cuda:0,1"]
[models.options]
path = "/models/lm"
tensor_parallel = 2
"""

# What this renderer uses of KEDA's ScaledObject CRD (keda.sh/v1alpha1, KEDA 2.x): kubernetes-validate has
# the built-in kinds only, so the custom resource is checked against this part of its schema.
SCALED_OBJECT_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                   "properties": {"name": {"type": "string"}, "kind": {"type": "string"},
                                                  "apiVersion": {"type": "string"}}},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer"},
                "cooldownPeriod": {"type": "integer"},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                    "properties": {"type": {"const": "prometheus"},
                                   "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                   "metadata": {"type": "object", "required": ["serverAddress", "query", "threshold"],
                                                "additionalProperties": {"type": "string"}}}}},
            },
        },
    },
}  # fmt: skip


def manifests(toml: str = EVERY_KIND, **options) -> list[dict]:
    opts = RenderOptions(**options)
    return render(pod_plan(parse_config(toml), opts), opts)


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def container(deployment: dict) -> dict:
    [c] = deployment["spec"]["template"]["spec"]["containers"]
    return c


def env(c: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def test_every_manifest_validates_against_the_kubernetes_api_schemas():
    import jsonschema

    objs = manifests(namespace="serving", models_pvc="weights")
    kinds = {o["kind"] for o in objs}
    assert kinds == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "ScaledObject",
                     "HorizontalPodAutoscaler"}  # fmt: skip
    for obj in objs:
        if obj["kind"] == "ScaledObject":
            jsonschema.validate(obj, SCALED_OBJECT_SCHEMA)
            continue
        # through YAML, as kubectl reads it: what the schema sees is what the file says
        obj = yaml.safe_load(yaml.safe_dump(obj))
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises ValidationError


def test_broker_is_one_recreated_replica_with_a_service_for_its_three_endpoints():
    objs = manifests()
    broker = by_kind(objs, "Deployment")["zserve-broker"]
    assert broker["spec"]["replicas"] == 1 and broker["spec"]["strategy"] == {"type": "Recreate"}
    c = container(broker)
    assert c["args"] == ["child", "-c", "/etc/zserve/supervisor.toml", "broker"]  # the image's entrypoint: zserve
    assert broker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 12 + 5
    service = by_kind(objs, "Service")["zserve-broker"]
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [
        ("client", 5555),
        ("work", 5556),
        ("out", 5557),
    ]
    pod_config = parse_config(by_kind(objs, "ConfigMap")["zserve-config"]["data"]["supervisor.toml"])
    b = pod_config.broker
    assert (b.client_endpoint, b.work_endpoint, b.out_endpoint) == ("tcp://0.0.0.0:5555", "tcp://0.0.0.0:5556",
                                                                    "tcp://0.0.0.0:5557")  # fmt: skip
    assert (
        b.curve_key == "/var/run/zserve/keys/broker.key_secret"
        and b.authorized_keys_dir == "/var/run/zserve/authorized"
    )
    volumes = {v["name"]: v for v in broker["spec"]["template"]["spec"]["volumes"]}
    assert {i["key"] for i in volumes["authorized"]["secret"]["items"]} == {"worker.key", "frontend.key"}
    assert {i["key"] for i in volumes["keys"]["secret"]["items"]} == {"broker.key_secret"}


def test_engines_replicas_gpus_cpu_names_and_probes():
    objs = manifests()
    deployments = by_kind(objs, "Deployment")
    mini = deployments["zserve-engine-mini-lm-v2"]  # a model name made a DNS label
    assert mini["spec"]["replicas"] == 4  # 2 devices x engines_per_device 2
    c = container(mini)
    assert c["resources"] == {"requests": {"cpu": "3"}, "limits": {"nvidia.com/gpu": "1"}}
    assert mini["spec"]["template"]["metadata"]["annotations"] == {"zserve.dev/engines-per-device": "2"}
    assert c["command"] == ["python", "-m", "zserve.workers.engine"]
    args = c["args"]
    assert args[args.index("--name") + 1] == "engine-mini_LM.v2@$(POD_NAME)"  # unique per pod
    assert args[args.index("--device") + 1] == "cuda:0"
    assert args[args.index("--work-endpoint") + 1] == "tcp://zserve-broker:5556"
    assert args[args.index("--curve-key") + 1] == "/var/run/zserve/keys/worker.key_secret"
    e = env(c)
    assert "CUDA_VISIBLE_DEVICES" not in e and e["OMP_NUM_THREADS"] == "3"  # the device plugin picks the GPU
    assert e["ZSERVE_MODEL_JSON"] == {"configMapKeyRef": {"name": "zserve-config", "key": "model.mini_LM.v2.json"}}
    assert c["readinessProbe"]["exec"]["command"] == ["test", "-e", "/tmp/zserve-worker/registered"]
    assert "alive" in c["livenessProbe"]["exec"]["command"][-1]
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600  # startup_timeout_s
    assert mini["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 45  # shutdown_timeout_s

    lm = container(deployments["zserve-engine-lm"])
    assert lm["resources"] == {"requests": {"cpu": "4"}, "limits": {"nvidia.com/gpu": "2"}}  # a tensor-parallel pair
    echo = deployments["zserve-engine-echo"]
    assert echo["spec"]["replicas"] == 2 and container(echo)["resources"] == {"requests": {"cpu": "1"}}
    stage = deployments["zserve-stage-mini-lm-v2"]
    assert stage["spec"]["replicas"] == 2 and container(stage)["command"][-1] == "zserve.workers.preprocess"
    assert env(container(stage))["CUDA_VISIBLE_DEVICES"] == ""
    # only models whose handler overrides preprocess get stages; the generative one is batched in its engine
    assert {n for n in deployments if n.startswith("zserve-stage-")} == {
        "zserve-stage-mini-lm-v2", "zserve-stage-classifier", "zserve-stage-reranker", "zserve-stage-vit"}  # fmt: skip
    config_map = by_kind(objs, "ConfigMap")["zserve-config"]["data"]
    assert json.loads(config_map["model.mini_LM.v2.json"])["engines"] == 4


def test_frontends_service_probes_keys_and_autoscalers():
    objs = manifests()
    front = by_kind(objs, "Deployment")["zserve-frontend"]
    c = container(front)
    assert c["command"][:4] == ["python", "-m", "zserve.deploy.k8s_pod", "frontend"]
    assert c["args"][c["args"].index("--bind") + 1] == "0.0.0.0:8080" and "--workers" in c["args"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["resources"] == {"requests": {"cpu": "2"}}
    assert front["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 7 + 5
    settings = json.loads(by_kind(objs, "ConfigMap")["zserve-config"]["data"]["frontend.json"])
    assert settings["client_endpoint"] == "tcp://zserve-broker:5555"
    assert settings["api_keys_file"] == "/var/run/zserve/api-keys/api_keys"
    assert by_kind(objs, "Service")["zserve-frontend"]["spec"]["ports"][0]["port"] == 8080
    hpas = by_kind(objs, "HorizontalPodAutoscaler")
    assert hpas["zserve-frontend"]["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    stage = hpas["zserve-stage-mini-lm-v2"]["spec"]  # stages scale on CPU too, from their configured count
    assert (stage["minReplicas"], stage["maxReplicas"]) == (2, 8) and "zserve-engine-echo" not in hpas
    scaled = by_kind(objs, "ScaledObject")
    assert set(scaled) == {f"zserve-engine-{n}" for n in ("echo", "mini-lm-v2", "classifier", "reranker", "vit", "lm")}
    echo = scaled["zserve-engine-echo"]["spec"]
    assert (echo["minReplicaCount"], echo["maxReplicaCount"]) == (2, 8)
    [trigger] = echo["triggers"]
    assert 'zserve_queue_depth{model="echo"}' in trigger["metadata"]["query"]
    assert trigger["metadata"]["threshold"] == str(32 * 2)  # what one engine holds: max_batch_size x credits
    pdbs = by_kind(objs, "PodDisruptionBudget")
    assert "zserve-broker" not in pdbs and pdbs["zserve-engine-echo"]["spec"]["maxUnavailable"] == 1


def test_auth_health_probes_insecure_and_refusals():
    toml = EVERY_KIND.replace("api_keys_file", "auth_health = true\napi_keys_file")
    front = container(by_kind(manifests(toml), "Deployment")["zserve-frontend"])
    assert "tcpSocket" in front["readinessProbe"]  # a probe cannot send an API key
    insecure = "[broker]\ninsecure = true\ninsecure_any_host = true\n"
    insecure += '[[models]]\nname = "e"\nhandler = "zserve.models.echo:Echo"\n'
    objs = manifests(insecure)
    assert all("--curve-key" not in container(d)["args"] for d in by_kind(objs, "Deployment").values())
    with pytest.raises(ConfigError, match="insecure_any_host"):
        manifests(insecure.replace("insecure_any_host = true\n", ""))
    with pytest.raises(ConfigError, match="mixes cpu and cuda"):
        manifests(insecure + 'devices = ["cpu", "cuda:0"]\n')


def test_the_command_writes_one_file_per_object(tmp_path):
    config = tmp_path / "supervisor.toml"
    config.write_text(EVERY_KIND)
    out = tmp_path / "manifests"
    run = subprocess.run([sys.executable, "-m", "zserve.cli", "k8s", "-c", str(config), "-o", str(out),
                          "--image", "registry.example/zserve:1.0-cuda"], env=subprocess_env(), capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    files = sorted(out.glob("*.yaml"))
    assert files[0].name == "00-configmap-zserve-config.yaml" and len(files) == len(manifests())
    text = files[1].read_text()
    assert "kubectl create secret generic zserve-keys" in text and "&id" not in text  # no YAML aliases
    assert (
        yaml.safe_load(text)["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/zserve:1.0-cuda"
    )
    bad = subprocess.run([sys.executable, "-m", "zserve.cli", "k8s", "-c", str(Path(tmp_path / "nope.toml"))],
                         env=subprocess_env(), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2
