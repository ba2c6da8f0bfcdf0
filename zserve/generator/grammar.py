"""Structured output: JSON (any object, or one JSON schema) enforced token by token with xgrammar.

xgrammar was picked over llguidance for this first cut because it ships the pieces the batched sampler needs
as they are (a compiled grammar cached per schema, one matcher per sequence filling a row of a shared int32
bitmask, ``apply_token_bitmask_inplace`` on CPU and CUDA logits, rows chosen by ``indices``), and vLLM and
SGLang both default to it. (Measured on this machine; see docs/openai.md.)

Where the work happens: a schema is compiled when its request is prepared, on the engine's link thread
(``Generator.prepare``), never on the step thread, and compiled grammars are cached by schema text;
in the step, only the rows with a grammar fill their bitmask row (a C++ call each) and are masked in one
call; after sampling each such row's matcher accepts its token. A sequence whose grammar is complete ends
with "stop".
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch

from zserve.errors import BadRequest

_ANY_OBJECT = '{"type": "object", "additionalProperties": true}'
_CACHE_SIZE = 256  # compiled grammars kept (a schema's compilation is milliseconds to a second)


def available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


class Grammars:
    """Compiles JSON grammars for one tokenizer (cached by schema text) and makes matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()  # the link thread compiles, in-process generate too

    def compile(self, schema: str | None) -> Any:
        """A compiled grammar for one JSON value matching ``schema`` (JSON text), or any JSON object
        (None). A schema xgrammar cannot compile is a ``BadRequest`` naming ``response_format``."""
        key = "" if schema is None else schema
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            # json_object: OpenAI's "an object", any keys (the builtin JSON grammar would allow any value)
            text = _ANY_OBJECT if schema is None else schema
            json.loads(text)
            compiled = self._compiler.compile_json_schema(text, any_whitespace=False)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its parser's message
            raise BadRequest(f"the JSON schema cannot be compiled: {exc}", field="response_format") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


def matcher(compiled: Any) -> Any:
    """A sequence's grammar state, at its start."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


def mask(logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
    """Ban, in place, every token the row's grammar does not allow next; only ``rows`` are touched."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for row, matcher in zip(rows, matchers, strict=True):
        matcher.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[1], indices=rows)
