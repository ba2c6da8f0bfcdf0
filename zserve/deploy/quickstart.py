"""``zserve serve MODEL``: a one-model deployment without a config file. The task (which built-in handler
serves it) is read from the model's ``config.json`` where it can be, the rest are defaults a user can see
with ``--print-config``: the same ``supervisor.toml`` that ``zserve up -c`` takes, to grow into."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import msgspec

from zserve.config import Config, ConfigError, FrontendsConfig, ModelConfig

HANDLERS = {
    "embed": "zserve.models.embedding:SentenceEmbedding",
    "classify": "zserve.models.classification:SequenceClassification",
    "rerank": "zserve.models.rerank:CrossEncoderRerank",
    "image-classify": "zserve.models.image_classification:ImageClassification",
    "generate": "zserve.models.causal_lm:CausalLM",
}
# Text batch models are batched by tokens: a batch pads to its longest item, so this budget is what one
# batch may compute (Hugging Face text-embeddings-inference's default max_batch_tokens).
TEXT_BATCH_TOKENS = 16_384
_TEXT_TASKS = ("embed", "classify", "rerank")


def read_model_config(model: str) -> tuple[dict[str, Any] | None, Path | None]:
    """(config.json's content or None, the local folder or None). A name that is not a folder is taken as a
    hub name; its config.json is fetched only where a hub is reachable."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        path = folder / "config.json"
        return (json.loads(path.read_text()) if path.is_file() else None), folder.resolve()
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(model, "config.json", etag_timeout=5)).read_text()), None
    except Exception as exc:  # no hub here, no such repository, no network: say so, and how to go on
        raise ConfigError(
            f"{model!r} is not a local folder and its config.json could not be fetched from a hub "
            f"({type(exc).__name__}); give a folder saved with save_pretrained"
        ) from None


def sentence_transformers_task(folder: Path | None) -> str | None:
    """The task of a sentence-transformers folder (``modules.json`` or ``config_sentence_transformers.json``):
    rerank for a CrossEncoder, embed for a SentenceTransformer; None for any other folder."""
    if folder is None:
        return None
    library_config = folder / "config_sentence_transformers.json"
    if library_config.is_file():
        model_type = json.loads(library_config.read_text()).get("model_type", "SentenceTransformer")
        if model_type == "CrossEncoder":
            return "rerank"
        if model_type != "SentenceTransformer":
            raise ConfigError(f"{folder}: a sentence-transformers {model_type}, which zserve does not serve")
        return "embed"
    return "embed" if (folder / "modules.json").is_file() else None


def infer_task(config: dict[str, Any] | None, folder: Path | None) -> str:
    """The task of a model from its config.json (``architectures``), or a ConfigError saying to pass --task."""
    if config is None:
        if folder is not None and any(folder.glob("*.gguf")):
            return "generate"
        raise ConfigError(f"{folder}: no config.json to read the task from; give --task ({', '.join(HANDLERS)})")
    architectures = config.get("architectures") or []
    library_task = sentence_transformers_task(folder)
    if library_task is not None:  # before architectures: Qwen3-Embedding's config says Qwen3ForCausalLM
        return library_task
    for arch in architectures:
        if arch.endswith("ForSequenceClassification"):
            labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 2))
            return "rerank" if labels == 1 else "classify"  # one output: a cross-encoder's relevance
        if arch.endswith("ForImageClassification"):
            return "image-classify"
        if arch.endswith(("ForCausalLM", "LMHeadModel")):
            return "generate"
    if any(arch.endswith("Model") for arch in architectures):
        return "embed"  # a bare encoder: mean-pooled sentence embeddings
    raise ConfigError(f"cannot tell the task from architectures {architectures}; give --task ({', '.join(HANDLERS)})")


def model_name(model: str) -> str:
    """A valid ``[[models]] name`` from a folder or hub name (its last part)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model.rstrip("/")).name).strip("-._")[:64]
    return name or "model"


def parse_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE read as TOML (numbers, booleans, quoted strings), else as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--option {text!r} must look like KEY=VALUE")
    try:
        parsed = msgspec.toml.decode(f"v = {value}")["v"]
    except msgspec.DecodeError:
        parsed = value
    return key.strip(), parsed


def serve_config(
    model: str,
    task: str | None = None,
    *,
    name: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    workers: int = 0,
    engines: int = 1,
    threads: int | None = None,
    max_batch_size: int = 32,
    options: dict[str, Any] | None = None,
) -> Config:
    """The deployment ``zserve serve`` runs: one model, its task's handler, this machine's defaults."""
    model_json, folder = read_model_config(model)
    task = task or infer_task(model_json, folder)
    if task not in HANDLERS:
        raise ConfigError(f"--task {task!r} is not one of {', '.join(HANDLERS)}")
    path = str(folder) if folder is not None else model
    handler_options: dict[str, Any] = {"path": path}
    if task == "generate" and model_json is None and folder is not None:
        handler_options["gguf_file"] = sorted(p.name for p in folder.glob("*.gguf"))[0]
    handler_options.update(options or {})
    cores = os.cpu_count() or 1
    fields: dict[str, Any] = {
        "name": name or model_name(model),
        "handler": HANDLERS[task],
        "engines": engines,
        "threads": threads or max(1, cores // engines),
        "max_batch_size": max_batch_size,
        "options": handler_options,
    }
    if task in _TEXT_TASKS:
        fields["max_batch_cost"] = TEXT_BATCH_TOKENS
    if task == "generate":
        fields.update(max_queue=256, timeout_ms=600_000)
    try:
        return Config(
            frontends=FrontendsConfig(host=host, port=port, workers=workers),
            models=[msgspec.convert(fields, ModelConfig)],
        )
    except (msgspec.ValidationError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
