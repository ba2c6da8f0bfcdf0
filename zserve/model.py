"""``zserve.Model``: the one class a user writes. Its lifecycle: docs/architecture.md.

decode_request (frontend, per request) -> batch (broker) -> preprocess (stage, CPU, on the batch)
-> predict (engine, on the batch) -> encode_response (frontend, per request). ``setup`` runs only in
engine processes and ``setup_preprocess`` only in preprocess stages, so weights are loaded once per engine
and never in frontends or stages. A model that does not override ``preprocess`` has no stage at all.
"""

from __future__ import annotations

import importlib
from typing import Any


class Model:
    """Base class of served models. Override ``predict``; every other hook has a working default.

    Options from the model's ``[models.options]`` table arrive as keyword arguments to the constructor
    and are kept in ``self.options``. The constructor also runs in frontend processes (for the
    request/response hooks), so it must stay cheap: load weights in ``setup``.
    """

    # True for autoregressive models (``zserve.models.causal_lm:CausalLM``): their engine batches sequences
    # at every step instead of running the broker's batches, and they can stream.
    generative: bool = False
    # True for a cheap ``preprocess`` (tokenising): an idle engine then runs it itself on the batch the broker
    # sends it, instead of waiting for a stage's hops (about 2 ms of a lone request's latency); under load, batches
    # still go through the stages. Leave it False for heavy preprocessing (decoding images), which would hold up
    # the engine's IO thread.
    preprocess_in_idle_engine: bool = False

    def __init__(self, **options: Any) -> None:
        self.options = options

    def setup(self, device: str) -> None:
        """Load weights onto ``device`` ("cpu", "cuda:0", ...). Runs once in each engine process."""

    def warmup(self) -> None:
        """Run once after ``setup``, before the engine takes traffic (compile kernels, fill caches)."""

    def setup_preprocess(self) -> None:
        """Load what ``preprocess`` needs (a tokenizer, an image codec; never the weights). Runs once in
        each preprocess stage process."""

    def preprocess(self, items: list[Any]) -> Any:
        """CPU work on the whole batch the broker formed (tokenising, decoding images), in a pool of stage
        processes that overlaps with the engines. Return the batch ``predict`` receives: any payload value,
        e.g. a dict of numpy arrays (they travel as raw frames). Not overriding it skips the stage."""
        return items

    def decode_request(self, body: Any) -> Any:
        """Turn a request body (parsed JSON, or the direct client's payload) into one batch item.
        Raise ``zserve.BadRequest(message, field=...)`` to reject it with a 400."""
        return body

    def cost(self, item: Any) -> int:
        """What ``item`` (a ``decode_request`` result) costs to compute, for a model batched by cost
        (``max_batch_cost``): tokens for a text model, pixels for an image one. Runs in the frontends, per
        request, so it must be cheap. Only models with ``max_batch_cost`` set are asked."""
        return 1

    def predict(self, batch: Any) -> list[Any]:
        """Run the model on a batch (the list of items, or what ``preprocess`` returned for them); return
        one output per item, in order. An output that is an ``Exception`` fails that item only."""
        raise NotImplementedError(f"{type(self).__name__}.predict is not implemented")

    def encode_response(self, output: Any) -> Any:
        """Turn one output into the JSON-able response body (numpy arrays become lists)."""
        return output


def reports_cost(cls: type[Model]) -> bool:
    """True if the model overrides ``cost``: only then can it be batched by cost."""
    return getattr(cls, "cost", None) is not Model.cost


def uses_preprocess(cls: type[Model]) -> bool:
    """True if the model overrides ``preprocess``: it then runs on a preprocess stage before ``predict``."""
    return getattr(cls, "preprocess", None) is not Model.preprocess


def setup_inline(model: Model, device: str = "cpu") -> None:
    """Both halves in one process (no stage): ``setup_preprocess`` if used, then ``setup`` and ``warmup``."""
    if uses_preprocess(type(model)):
        model.setup_preprocess()
    model.setup(device)
    model.warmup()


def predict_inline(model: Model, items: list[Any]) -> list[Any]:
    """``predict(preprocess(items))``, in this process: what a stage and an engine do together."""
    return model.predict(model.preprocess(items) if uses_preprocess(type(model)) else items)


def load_handler(spec: str, options: dict[str, Any] | None = None) -> Model:
    """Instantiate ``"package.module:Class"`` with ``options``; errors say what is wrong with ``spec``."""
    module_name, _, class_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"handler {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"handler {spec!r}: module {module_name!r} has no attribute {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Model)):
        raise ValueError(f"handler {spec!r} is not a subclass of zserve.Model")
    try:
        return cls(**(options or {}))
    except TypeError as exc:
        raise ValueError(f"handler {spec!r}: bad options {sorted(options or {})}: {exc}") from exc
