"""Devices: the config, the engine -> CUDA_VISIBLE_DEVICES mapping, and the host check (no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cluster import subprocess_env

from zserve.config import ConfigError, parse_config
from zserve.deploy.plan import plan
from zserve.devices import check_devices, gpu_count

GPU_MODEL = """
[[models]]
name = "m"
handler = "zserve.models.echo:Echo"
devices = ["cuda:0", "cuda:1"]
engines_per_device = 2
"""


def test_engines_per_device_gives_each_device_its_engines_through_cuda_visible_devices(tmp_path):
    config = parse_config(GPU_MODEL)
    model = config.models[0]
    assert model.engines == 4
    deployment = plan(config, tmp_path / "s.toml")
    children = [deployment.engine(model, i) for i in range(model.engines)]
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in children] == ["0", "1", "0", "1"]
    for child in children:  # the engine sees its one device as cuda:0
        assert child.argv[child.argv.index("--device") + 1] == "cuda:0"
    stage = deployment.stage(model, 0)
    assert stage.env["CUDA_VISIBLE_DEVICES"] == ""
    cpu = parse_config(GPU_MODEL.replace('"cuda:0", "cuda:1"', '"cpu"')).models[0]
    assert "CUDA_VISIBLE_DEVICES" not in deployment.engine(cpu, 0).env
    pairs = parse_config(GPU_MODEL.replace('"cuda:0", "cuda:1"', '"cuda:0,1", "cuda:2,3"')).models[0]
    group = deployment.engine(pairs, 1)  # a tensor parallel engine: its group's ranks see both, as cuda:0 and 1
    assert group.env["CUDA_VISIBLE_DEVICES"] == "2,3" and group.argv[group.argv.index("--device") + 1] == "cuda:0"


@pytest.mark.parametrize(
    ("hunk", "expected"),
    [
        ('devices = ["gpu0"]', "must each be 'cuda:N' or 'cpu'"),
        ('devices = ["cuda:0,"]', "or 'cuda:N,M,...' for an engine on several devices"),
        ("engines_per_device = 2", "engines_per_device needs devices"),
        ('devices = ["cuda:0"]\nengines_per_device = 2\nengines = 3', "contradicts"),
    ],
)
def test_bad_device_settings_are_rejected_by_key(hunk, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_config(f'[[models]]\nname = "m"\nhandler = "zserve.models.echo:Echo"\n{hunk}\n')


def test_a_host_without_the_devices_rejects_the_config_unless_devices_is_empty(monkeypatch):
    models = parse_config(GPU_MODEL).models
    with pytest.raises(ConfigError, match=r"cuda:0, cuda:1 not on this host, which has no CUDA device"):
        check_devices(models, count=0)
    with pytest.raises(ConfigError, match=r"cuda:1 not on this host, which has 1 CUDA device"):
        check_devices(models, count=1)
    check_devices(models, count=2)
    cpu_only = parse_config('[[models]]\nname = "m"\nhandler = "zserve.models.echo:Echo"\ndevices = ["cpu"]\n')
    check_devices(cpu_only.models, count=0)
    pairs = parse_config(GPU_MODEL.replace('"cuda:0", "cuda:1"', '"cuda:0,1", "cuda:2,3"')).models
    with pytest.raises(ConfigError, match=r"cuda:2,3 not on this host, which has 3 CUDA device"):
        check_devices(pairs, count=3)
    check_devices(pairs, count=4)
    monkeypatch.setenv("ZSERVE_GPU_COUNT", "3")
    assert gpu_count() == 3


def test_zserve_up_on_a_cpu_only_host_refuses_cuda_devices_and_never_imports_torch(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(GPU_MODEL)
    env = {**subprocess_env(), "ZSERVE_GPU_COUNT": "0"}
    run = subprocess.run(
        [sys.executable, "-m", "zserve.cli", "up", "-c", str(path)], capture_output=True, text=True, env=env, timeout=60
    )
    assert run.returncode == 2 and "models[m].devices: cuda:0, cuda:1 not on this host" in run.stderr
    probe = "import sys, zserve.devices as d; d.gpu_count(); print('torch' in sys.modules)"
    fresh = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert fresh.stdout.strip() == "False", fresh.stderr
