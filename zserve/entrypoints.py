"""``zserve.pipeline`` (in-process, no server) and ``zserve.serve`` (the full deployment, from Python).

The MII-style flow::

    pipe = zserve.pipeline("zserve.models.embedding:SentenceEmbedding")
    outputs = pipe(["DeepSpeed is", "Seattle is"])   # [{"embedding": array, "tokens": n}, ...]

    client = zserve.serve("supervisor.toml")        # or a handler: zserve.serve("pkg.mod:MyModel", port=8080)
    client.predict("minilm", {"text": "hello"})
    client.terminate()                               # stops every process it started
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from zserve.client import Client, endpoint_from_config
from zserve.config import Config, ConfigError, ModelConfig, _drop_retired_keys, load_config, to_toml
from zserve.model import Model, load_handler, predict_inline, setup_inline
from zserve.transport import free_tcp_port

_FRONTEND_KEYS = {"port", "host", "workers", "max_body_bytes"}


class Pipeline:
    """A model set up in this process; ``pipe(items)`` runs preprocess + predict in batches of
    ``max_batch_size`` and returns one output per item. Nothing is started; nothing persists."""

    def __init__(self, model: Model, *, device: str = "cpu", max_batch_size: int = 32) -> None:
        self.model = model
        self.max_batch_size = max_batch_size
        setup_inline(model, device)

    def __call__(self, items: Sequence[Any], **kwargs: Any) -> list[Any]:
        generate = getattr(self.model, "generate", None)
        if callable(generate):  # generative models: pipe(prompts, max_new_tokens=..., temperature=...)
            return generate(items, **kwargs)
        if kwargs:
            raise TypeError(
                f"{type(self.model).__name__} is a batch model and takes no generation options {sorted(kwargs)}; "
                "generative pipelines come with the generative engine"
            )
        items = list(items)
        out: list[Any] = []
        for start in range(0, len(items), self.max_batch_size):
            out += predict_inline(self.model, items[start : start + self.max_batch_size])
        return out


def _model_of(model_or_handler: Model | type[Model] | str, options: dict[str, Any]) -> Model:
    if isinstance(model_or_handler, Model):
        if options:
            raise TypeError("options are for a handler or class; this model is constructed already")
        return model_or_handler
    if isinstance(model_or_handler, type) and issubclass(model_or_handler, Model):
        return model_or_handler(**options)
    return load_handler(str(model_or_handler), options)


def pipeline(
    model_or_handler: Model | type[Model] | str, *, device: str = "cpu", max_batch_size: int = 32, **options: Any
) -> Pipeline:
    """In-process, non-persistent: ``zserve.pipeline("pkg.mod:Class", path=...)(items)``. Options go to
    the model's constructor, as ``[models.options]`` would."""
    return Pipeline(_model_of(model_or_handler, options), device=device, max_batch_size=max_batch_size)


class ServedClient(Client):
    """A Client of a deployment that ``serve`` started; ``terminate()`` stops that deployment."""

    def __init__(
        self, endpoint: str, process: subprocess.Popen, url: str, workdir: Path, output: list[str], models: list[str]
    ) -> None:
        super().__init__(endpoint)
        self.models = models
        self.process = process
        self.url = url
        self._workdir = workdir
        self._output = output

    def generate(self, prompts: str | list[str], *, model: str | None = None, **sampling: Any) -> list:
        """Like ``Client.generate``; ``model`` defaults to the deployment's only model."""
        if model is None:
            if len(self.models) != 1:
                raise TypeError(f"this deployment serves {self.models}: say which with model=")
            model = self.models[0]
        return super().generate(prompts, model=model, **sampling)

    @property
    def output(self) -> str:
        """Everything the deployment printed so far."""
        return "".join(self._output)

    def terminate(self, timeout_s: float = 60.0) -> int:
        """Stop the deployment in order (as Ctrl-C would) and wait for it; returns its exit code."""
        self.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            code = self.process.wait()
        shutil.rmtree(self._workdir, ignore_errors=True)
        return code


def _config_for(target: str | os.PathLike[str] | Model | type[Model], overrides: dict[str, Any]) -> Config:
    if isinstance(target, str | os.PathLike) and (str(target).endswith(".toml") or Path(target).is_file()):
        config = load_config(target)
    else:
        model = _model_of(target, overrides.pop("options", {}))
        handler = f"{type(model).__module__}:{type(model).__qualname__}"
        if type(model).__module__ == "__main__":
            raise ConfigError(f"{handler}: engines import the model by name; define it in a module, not in __main__")
        name = overrides.pop("name", type(model).__name__.lower())
        model_keys = {k: overrides.pop(k) for k in list(overrides) if k in ModelConfig.__struct_fields__}
        spec = ModelConfig(name=name, handler=handler, options=model.options, **model_keys)
        config = Config(models=[spec])
        config.frontends.port = free_tcp_port()
    if "server" in overrides:  # retired as [frontends] server is: "gunicorn" warns and is ignored, others refused
        _drop_retired_keys({"frontends": {"server": overrides.pop("server")}}, "zserve.serve(server=...)")
    frontends = {k: overrides.pop(k) for k in list(overrides) if k in _FRONTEND_KEYS}
    if overrides:
        raise TypeError(f"unknown overrides {sorted(overrides)}")
    config = msgspec.structs.replace(config, frontends=msgspec.structs.replace(config.frontends, **frontends))
    return msgspec.convert(msgspec.to_builtins(config), Config)  # validates the overrides


def serve(
    config_or_model: str | os.PathLike[str] | Model | type[Model],
    *,
    startup_timeout_s: float = 600.0,
    **overrides: Any,
) -> ServedClient:
    """Start the full deployment (``zserve up``) in the background, wait until it is ready, and return a
    connected client whose ``terminate()`` stops it. ``config_or_model`` is a supervisor.toml, or a model
    (handler string, class or instance) served alone. Overrides: ``port``, ``host``, ``workers``,
    ``max_body_bytes`` ([frontends]); with a model also ``name``, ``options`` and any ``[[models]]`` key.
    ``server`` is deprecated (gunicorn is the only frontend server): ``server="gunicorn"`` is ignored with a
    FutureWarning, any other value is a ConfigError."""
    config = _config_for(config_or_model, dict(overrides))
    workdir = Path(tempfile.mkdtemp(prefix="zserve-serve-"))
    path = workdir / "supervisor.toml"
    path.write_text(to_toml(config))
    process = subprocess.Popen(
        [sys.executable, "-m", "zserve.cli", "up", "-c", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output: list[str] = []
    ready = threading.Event()
    url: list[str] = []

    def read() -> None:
        for line in process.stdout:
            output.append(line)
            if line.startswith("zserve ready: "):
                url.append(line.split(": ", 1)[1].strip())
                ready.set()

    threading.Thread(target=read, name="zserve-serve-output", daemon=True).start()
    deadline = time.monotonic() + startup_timeout_s
    while not ready.wait(0.1):
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=60)
            shutil.rmtree(workdir, ignore_errors=True)
            tail = "".join(output[-40:])
            raise RuntimeError(f"zserve up did not get ready (exit {process.poll()}):\n{tail}")
    return ServedClient(endpoint_from_config(path), process, url[0], workdir, output, [m.name for m in config.models])
