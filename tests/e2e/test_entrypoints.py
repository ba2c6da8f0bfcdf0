"""zserve.pipeline (in-process) and zserve.serve (the whole deployment, from Python)."""

from __future__ import annotations

import numpy as np
import psutil
import pytest
from cluster import subprocess_env
from deployment import alive, free_port, write_config

import zserve
from zserve.models.echo import Echo


def test_pipeline_runs_preprocess_and_predict_in_process():
    pipe = zserve.pipeline("zserve.models.embedding:SentenceEmbedding", max_batch_size=2)
    outputs = pipe(["DeepSpeed is", "Seattle is", "a third one"])
    assert len(outputs) == 3 and outputs[0]["embedding"].shape == (384,) and outputs[0]["tokens"] > 2
    np.testing.assert_allclose(outputs[2]["embedding"], pipe(["a third one"])[0]["embedding"], atol=1e-5)
    assert zserve.pipeline(Echo)([1, {"a": 2}]) == [1, {"a": 2}]
    with pytest.raises(TypeError, match="batch model"):
        pipe(["x"], max_new_tokens=8)


def test_serve_a_handler_then_terminate_leaves_nothing_running(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])
    client = zserve.serve("testmodels:SlowEcho", name="slow", options={"delay_s": 0.01}, max_batch_size=8)
    try:
        futures = [client.submit("slow", i) for i in range(32)]
        assert [f.result(timeout=30)["echo"] for f in futures] == list(range(32))
        assert client.url.startswith("http://127.0.0.1:")
        everything = psutil.Process(client.process.pid).children(recursive=True)
        assert len(everything) >= 4  # broker, engine, gunicorn master and worker(s)
    finally:
        code = client.terminate()
    assert code == 0
    assert alive(everything) == []


def test_serve_a_config_file_with_overrides(tmp_path):
    path = write_config(tmp_path, '[[models]]\nname = "echo"\nhandler = "zserve.models.echo:Echo"\n')
    port = free_port()
    client = zserve.serve(path, port=port, workers=1)
    try:
        assert client.url == f"http://127.0.0.1:{port}"
        assert client.predict("echo", ["hi"]) == ["hi"]
    finally:
        assert client.terminate() == 0
    with pytest.raises(TypeError, match="unknown overrides"):
        zserve.serve(path, colour="blue")
