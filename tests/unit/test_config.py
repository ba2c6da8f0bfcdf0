from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from zserve.config import ConfigError, endpoints_for, load_config, parse_config, run_dir_for
from zserve.errors import field_of, validation_parts

REPO = Path(__file__).resolve().parents[2]
MODEL = '[[models]]\nname = "m"\nhandler = "zserve.models.echo:Echo"\n'


def test_the_default_deployment_parses():
    config = load_config(REPO / "supervisor.toml")
    assert [m.name for m in config.models] == ["echo", "minilm", "smollm2"]
    assert config.frontends.host == "127.0.0.1" and config.frontends.port == 8000


@pytest.mark.parametrize(("cores", "workers"), [(1, 1), (2, 1), (3, 1), (16, 8)])
def test_frontend_workers_default_to_half_the_cores(monkeypatch, cores, workers):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    assert parse_config(MODEL).frontends.workers == workers
    assert parse_config("[frontends]\nworkers = 3\n" + MODEL).frontends.workers == 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (MODEL + "max_batch_size = 0\n", "models[0].max_batch_size: Expected `int` >= 1"),
        (MODEL + "batch = 3\n", "models[0]: Object contains unknown field `batch`"),
        ("[frontend]\nworkers = 2\n" + MODEL, "unknown field `frontend`"),
        ("[frontends]\nport = 70000\n" + MODEL, "frontends.port: Expected `int` <= 65535"),
        ("[frontends]\nworkers = 'two'\n" + MODEL, "frontends.workers: Expected `int`, got `str`"),
        ("[frontends]\nworkers = -1\n" + MODEL, "frontends.workers: Expected `int` >= 0"),
        ('[[models]]\nname = "m"\nhandler = "no_colon"\n', "handler 'no_colon'"),
        ("", "at least one [[models]] table"),
        (MODEL + MODEL, "model names must be unique: m"),
        ("[broker\n", "not valid TOML"),
    ],
)
def test_errors_name_the_key(text, expected):
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert expected in str(info.value)


def test_run_dir_is_derived_from_the_config_path_and_endpoints_can_be_tcp(tmp_path):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    config = parse_config(MODEL)
    assert run_dir_for(config, a) == run_dir_for(config, a) != run_dir_for(config, b)
    ep = endpoints_for(config, run_dir_for(config, a))
    assert ep.client.startswith("ipc://") and ep.client.endswith("client.sock")
    tcp = parse_config('[broker]\nclient_endpoint = "tcp://127.0.0.1:5555"\ninsecure = true\n' + MODEL)
    assert endpoints_for(tcp, tmp_path).client.startswith("ipc://")  # this host's processes keep ipc
    assert tcp.broker.remote_endpoints() == ("tcp://127.0.0.1:5555", "", "")
    with pytest.raises(ConfigError, match="too long"):
        endpoints_for(config, tmp_path / ("x" * 120))


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    input: list[dict[str, int]] = []


@pytest.mark.parametrize(
    ("body", "parts", "field"),
    [
        ({"model": "m", "input": [{"a": "b"}]}, ("Expected `int`, got `str`", "input[0][...]"), "input"),
        ({}, ("Object missing required field `model`", ""), "model"),
        ({"model": "m", "tools": 1}, ("Object contains unknown field `tools`", ""), "tools"),
        ({"model": 1}, ("Expected `str`, got `int`", "model"), "model"),
    ],
)
def test_msgspecs_error_text_is_read_in_one_place(body, parts, field):
    """supervisor.toml's errors and the HTTP bodies' 400s read msgspec's text with the same two functions."""
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.convert(body, _Body)
    assert validation_parts(info.value) == parts and field_of(info.value) == field


@pytest.mark.parametrize("value", ["inf", "86400001", "0"])
def test_priority_aging_must_be_finite_and_positive(value):
    """Ranks are arrival + priority * aging: with inf, 0 * inf is NaN and the engines' queues lose their order."""
    with pytest.raises(ConfigError, match="priority_aging_ms"):
        parse_config(f"[broker]\npriority_aging_ms = {value}\n" + MODEL)
    assert parse_config("[broker]\npriority_aging_ms = 86400000\n" + MODEL).broker.priority_aging_ms == 86_400_000
