"""What `zserve k8s` renders, run as Kubernetes would run it, without Kubernetes: every pod of the manifests is a
process started from its container's command, args and environment (``$(VAR)`` expanded, ``configMapKeyRef``
and ``fieldRef`` resolved), in a network namespace of its own on a bridge, with its volumes bind-mounted where
the pod spec mounts them (the ConfigMap's files, the keys Secret's items, an emptyDir for /tmp) in a mount
namespace of its own, as the pod's runAsUser with its fsGroup owning the volumes (where this machine's Python
is reachable by that user; not when it lives under /root, 0700). Each Service is the address the test gives
its pod, in every pod's /etc/hosts. Readiness is the pod's own probes (exec run inside the pod, httpGet and
tcpSocket against its address).

Under HTTP load through the frontend pod: an engine pod is deleted (SIGTERM, then SIGKILL after
terminationGracePeriodSeconds), another added (a scale-up), a stage pod replaced, the broker pod deleted and
a new one started (a Recreate rollout), then killed and started again (a lost node): every request is
answered exactly once, with its own result. Skipped, saying
why, where network namespaces or bind mounts cannot be made (root and CAP_SYS_ADMIN/CAP_NET_ADMIN needed)."""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cluster import SUPPORT

from zserve.config import parse_config
from zserve.deploy.k8s import RenderOptions, pod_plan, render
from zserve.keys import generate

VENV_BIN = str(Path(sys.executable).parent)
# What the pods run from, where it lies under /tmp (over which each pod mounts its own /tmp volume)
_UNDER_TMP = [p for p in (Path(__file__).resolve(), Path(VENV_BIN)) if p.is_relative_to("/tmp")]

CONFIG = """
[supervisor]
shutdown_timeout_s = 4
startup_timeout_s = 60

[broker]
heartbeat_interval_ms = 100
heartbeat_liveness = 5
drain_timeout_s = 2

[frontends]
workers = 1
port = 8080
graceful_timeout_s = 2

[[models]]
name = "slow"
handler = "testmodels:SlowEcho"
engines = 2
max_batch_size = 4
max_wait_ms = 2
credits = 2
timeout_ms = 60000
[models.options]
delay_s = 0.02

[[models]]
name = "staged"
handler = "testmodels:Staged"
engines = 1
preprocess_workers = 1
max_batch_size = 4
max_wait_ms = 2
timeout_ms = 60000
"""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30)


class Network:
    """A bridge in this namespace; each pod gets a namespace, a veth on the bridge and the next address."""

    def __init__(self, tag: int) -> None:
        self.tag = tag
        self.bridge = f"zk{tag}"
        self.subnet = f"10.215.{tag % 250}"
        self.namespaces: list[str] = []
        self.hosts: dict[str, str] = {}  # Service name -> address
        self._next = 2
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        # A bridge takes the lowest MAC of its ports unless given one: a pod added later would change it, and
        # the pods' ARP entries for this side would point nowhere until they expire (a stall of ~60 s).
        _run("ip", "link", "set", self.bridge, "address", f"02:00:00:00:{tag // 256 % 256:02x}:{tag % 256:02x}")
        _run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")

    def address(self) -> str:
        self._next += 1
        return f"{self.subnet}.{self._next - 1}"

    def namespace(self, address: str) -> str:
        """A namespace that has ``address``; created once per address (a restarted pod keeps its Service's)."""
        n = address.rsplit(".", 1)[1]
        ns, ours, theirs = f"zk{self.tag}-{n}", f"zk{self.tag}h{n}", f"zk{self.tag}p{n}"
        if ns in self.namespaces:
            return ns
        for step in [
            ("netns", "add", ns),
            ("link", "add", ours, "type", "veth", "peer", "name", theirs),
            ("link", "set", ours, "master", self.bridge),
            ("link", "set", ours, "up"),
            ("link", "set", theirs, "netns", ns),
            ("-n", ns, "addr", "add", f"{address}/24", "dev", theirs),
            ("-n", ns, "link", "set", theirs, "up"),
            ("-n", ns, "link", "set", "lo", "up"),
        ]:
            _run("ip", *step)
        self.namespaces.append(ns)
        return ns

    def write_hosts(self) -> None:
        """Every pod resolves the Services (`ip netns exec` binds /etc/netns/NS/hosts over /etc/hosts)."""
        lines = "127.0.0.1 localhost\n" + "".join(f"{a} {name}\n" for name, a in self.hosts.items())
        for ns in self.namespaces:
            Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{ns}/hosts").write_text(lines)

    def close(self) -> None:
        for ns in self.namespaces:
            _run("ip", "netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        _run("ip", "link", "del", self.bridge, check=False)


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args ($$ escapes; an unknown $(VAR) stays as written)."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        text,
    )


def _runs_as(as_user: list[str]) -> bool:
    """Whether this machine's Python runs as that user (a pyenv under /root, mode 0700, does not)."""
    again = "import os, sys; os.execv(sys.executable, [sys.executable, '-c', 'pass'])"  # as `zserve child` does
    return subprocess.run([*as_user, sys.executable, "-c", again], capture_output=True, timeout=30).returncode == 0


class Pod:
    """One replica of a Deployment's pod template, as a process."""

    def __init__(self, name: str, spec: dict, address: str, ns: str, root: Path, data: dict, keys: Path) -> None:
        self.name, self.spec, self.address, self.ns = name, spec, address, ns
        [self.container] = spec["containers"]
        self.dir = root / name
        self.dir.mkdir(parents=True)
        self.log = self.dir / "log"
        mounts = []
        security = spec["securityContext"]  # the pod runs as its user, its volumes owned by its fsGroup
        uid, gid, fs_group = security["runAsUser"], security["runAsGroup"], security["fsGroup"]
        self.as_user = ["setpriv", f"--reuid={uid}", f"--regid={gid}", f"--groups={fs_group}", "--"]
        if not _runs_as(self.as_user):
            self.as_user = []
        volumes = {v["name"]: v for v in spec["volumes"]}
        for m in self.container["volumeMounts"]:
            v, src = volumes[m["name"]], self.dir / "volumes" / m["name"]
            src.mkdir(parents=True)
            if "configMap" in v:
                for key, text in data.items():
                    (src / key).write_text(text)
            elif "secret" in v:
                items = v["secret"].get("items") or [{"key": p.name, "path": p.name} for p in keys.iterdir()]
                for item in items:
                    shutil.copy(keys / item["key"], src / item["path"])
                    os.chown(src / item["path"], 0, fs_group)
                    os.chmod(src / item["path"], v["secret"].get("defaultMode", 0o644))
            elif "persistentVolumeClaim" in v:
                raise AssertionError("no PVC in this test")
            else:  # emptyDir
                os.chown(src, uid, fs_group)
            mounts.append((src, m["mountPath"]))
        env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "PYTHONPATH": str(SUPPORT)}
        for e in self.container.get("env", []):
            if "value" in e:
                env[e["name"]] = expand(e["value"], env)
            elif "configMapKeyRef" in e["valueFrom"]:
                env[e["name"]] = data[e["valueFrom"]["configMapKeyRef"]["key"]]
            else:
                assert e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
                env[e["name"]] = name
        argv = [expand(a, env) for a in [*self.container.get("command", ["zserve"]), *self.container.get("args", [])]]
        # The pod's filesystem view: its volumes over the paths its container mounts them at (/tmp last: the
        # other volumes' sources are under this machine's /tmp)
        mounts.sort(key=lambda m: m[1] == "/tmp")
        binds = []
        for source, target in mounts:
            if target == "/tmp":  # a checkout or virtualenv under this machine's /tmp (a CI clone) stays visible
                for top in sorted({Path("/tmp", p.relative_to("/tmp").parts[0]) for p in _UNDER_TMP}):
                    kept = source / top.name
                    binds.append(f"mkdir -p {shlex.quote(str(kept))} && mount --bind {shlex.quote(str(top))} "
                                 f"{shlex.quote(str(kept))}")  # fmt: skip
            binds.append(f"mkdir -p {shlex.quote(target)} && mount --rbind {shlex.quote(str(source))} "
                         f"{shlex.quote(target)}")  # fmt: skip
        binds = " && ".join(binds)
        script = f'{binds} && exec {shlex.join(self.as_user)} "$@"'
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(["ip", "netns", "exec", ns, "sh", "-c", script, "pod", *argv], env=env,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def probe(self, kind: str = "readinessProbe") -> bool:
        p = self.container[kind]
        if self.proc.poll() is not None:
            return False
        if "exec" in p:  # inside the pod: its mounts and network
            argv = ["nsenter", "-t", str(self.proc.pid), "-m", "-n", *self.as_user, *p["exec"]["command"]]
            run = subprocess.run(argv, capture_output=True, timeout=10, env={"PATH": f"{VENV_BIN}:/usr/bin:/bin"})
            return run.returncode == 0
        port = self.port(p.get("httpGet", p.get("tcpSocket"))["port"])
        if "tcpSocket" in p:
            try:
                socket.create_connection((self.address, port), timeout=2).close()
                return True
            except OSError:
                return False
        conn = http.client.HTTPConnection(self.address, port, timeout=2)
        try:
            conn.request("GET", p["httpGet"]["path"])
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def port(self, port: int | str) -> int:
        return (
            next(p["containerPort"] for p in self.container["ports"] if p["name"] == port)
            if isinstance(port, str)
            else port
        )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.probe():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"pod {self.name} not ready (exit {self.proc.poll()}):\n{self.output()[-4000:]}")
            time.sleep(0.1)

    def delete(self) -> tuple[int, float]:
        """kubectl delete pod: SIGTERM, SIGKILL after the grace period. (exit code, seconds it took)"""
        at = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=self.spec["terminationGracePeriodSeconds"])
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.wait()
        return code, time.monotonic() - at

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


class Cluster:
    def __init__(self, objs: list[dict], root: Path, keys: Path, net: Network) -> None:
        self.deployments = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
        self.services = [o["metadata"]["name"] for o in objs if o["kind"] == "Service"]
        [config_map] = [o for o in objs if o["kind"] == "ConfigMap"]
        self.data = config_map["data"]
        self.root, self.keys, self.net = root, keys, net
        self.pods: list[Pod] = []
        self.counter = 0

    def start(self, deployment: str, address: str | None = None) -> Pod:
        self.counter += 1
        spec = self.deployments[deployment]["spec"]["template"]["spec"]
        address = address or self.net.address()
        ns = self.net.namespace(address)
        if deployment.removeprefix("zserve-") in ("broker", "frontend"):  # this pod backs a Service
            self.net.hosts[deployment] = address
        self.net.write_hosts()
        pod = Pod(f"{deployment}-{self.counter}", spec, address, ns, self.root, self.data, self.keys)
        self.pods.append(pod)
        return pod

    def close(self) -> None:
        for pod in self.pods:
            if pod.proc.poll() is None:
                pod.kill()


@pytest.fixture
def k8s(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root: network namespaces, a bridge and bind mounts")
    for path in ("/etc/zserve", "/run/zserve/keys", "/run/zserve/authorized", "/run/zserve/api-keys"):
        Path(path).mkdir(parents=True, exist_ok=True)  # mount points only; every pod binds its own volume there
    try:
        net = Network(os.getpid() % 100_000)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        _run("ip", "link", "del", f"zk{os.getpid() % 100_000}", check=False)
        reason = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        pytest.skip(f"cannot create a bridge here: {reason}")
    keys = tmp_path / "keys"
    for name in ("broker", "worker", "frontend"):
        generate(keys, name)  # what the Secret holds: `kubectl create secret generic zserve-keys --from-file=keys/`
    opts = RenderOptions()
    objs = render(pod_plan(parse_config(CONFIG), opts), opts)
    cluster = Cluster(objs, tmp_path / "pods", keys, net)
    try:
        yield cluster
    finally:
        cluster.close()
        net.close()


class HttpLoad:
    """Closed-loop HTTP callers through the frontend Service; each body is unique and must come back as sent."""

    def __init__(self, address: str, port: int, callers: int = 6) -> None:
        self.address, self.port = address, port
        self.sent = 0
        self.ok: list[str] = []
        self.wrong: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(callers)]
        for t in self.threads:
            t.start()

    def run(self, caller: int) -> None:
        conn = http.client.HTTPConnection(self.address, self.port, timeout=60)
        i = 0
        while not self.stop.is_set():
            body = f"{caller}-{i}"
            i += 1
            self.sent += 1
            try:
                model = ("slow", "staged")[caller % 3 == 2]  # a third of the callers through the stage pod
                conn.request("POST", f"/v1/models/{model}/predict", body=json.dumps({"id": body}),
                             headers={"Content-Type": "application/json"})  # fmt: skip
                response = conn.getresponse()
                data = response.read()
            except OSError as exc:
                self.wrong.append(f"{body}: {exc!r}")
                conn.close()
                conn = http.client.HTTPConnection(self.address, self.port, timeout=60)
                continue
            if response.status == 200 and json.loads(data)["echo"] == {"id": body}:
                self.ok.append(body)
            else:
                self.wrong.append(f"{body}: {response.status} {data[:300]!r}")

    def wait_for(self, n: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.ok) < n:
            assert not self.wrong, self.wrong[:3]
            assert time.monotonic() < deadline, f"{len(self.ok)} of {n} answers after {timeout_s}s"
            time.sleep(0.05)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)


def test_the_rendered_pods_serve_through_an_engine_deleted_added_and_a_broker_restart(k8s):
    broker_address = k8s.net.address()
    broker = k8s.start("zserve-broker", broker_address)
    broker.wait_ready()
    engines = [k8s.start("zserve-engine-slow") for _ in range(2)]
    staged = [k8s.start("zserve-engine-staged"), k8s.start("zserve-stage-staged")]
    frontend = k8s.start("zserve-frontend")
    for pod in [*engines, *staged, frontend]:
        pod.wait_ready(timeout_s=90)
    load = HttpLoad(frontend.address, 8080)
    try:
        load.wait_for(100)

        code, took_s = engines[0].delete()  # a scale-down picks this pod
        assert code == 0 and took_s < 4, (code, took_s, engines[0].output()[-2000:])
        assert "told the broker it is leaving" in engines[0].output()
        load.wait_for(len(load.ok) + 100)

        added = k8s.start("zserve-engine-slow")  # a scale-up
        added.wait_ready(timeout_s=90)
        stage = k8s.start("zserve-stage-staged")  # a stage pod replaced, as a rollout does: the new one first
        stage.wait_ready(timeout_s=90)
        code, took_s = staged[1].delete()
        assert code == 0 and took_s < 4, (code, took_s, staged[1].output()[-2000:])
        staged[1] = stage
        load.wait_for(len(load.ok) + 100)

        first_broker = broker
        code, took_s = broker.delete()  # a rollout (Recreate): the old pod goes first, handing its queue back
        assert code == 0 and took_s < 4, (code, took_s, broker.output()[-2000:])
        broker = k8s.start("zserve-broker", broker_address)  # the new pod, behind the same Service
        broker.wait_ready()
        for pod in (engines[1], added, *staged, frontend):
            pod.wait_ready(timeout_s=30)  # registered with the new broker
        load.wait_for(len(load.ok) + 100)

        broker.kill()  # the node is lost
        broker = k8s.start("zserve-broker", broker_address)
        broker.wait_ready()
        for pod in (engines[1], added, *staged, frontend):
            pod.wait_ready(timeout_s=30)
        load.wait_for(len(load.ok) + 100)
    except BaseException:
        for pod in k8s.pods:  # shown by pytest with the failure
            print(f"---- pod {pod.name} (exit {pod.proc.poll()}) ----\n{pod.output()[-3000:]}")
        raise
    finally:
        load.finish()
    assert not load.wrong, load.wrong[:5]
    assert len(load.ok) == len(set(load.ok)) == load.sent  # each request answered once, with its result
    assert re.search(r"worker engine-slow@zserve-engine-slow-\d+:\d+ left", first_broker.output())
    assert "handing over" in first_broker.output()
    assert "worker engine-slow@" in broker.output(), broker.output()[-3000:]  # the workers joined the new broker
