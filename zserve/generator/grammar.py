"""Structured output: JSON (any object, or one JSON schema) enforced token by token with xgrammar.

xgrammar was picked over llguidance for this first cut because it ships the pieces the batched sampler needs
as they are (a compiled grammar cached per schema, one matcher per sequence filling a row of a shared int32
bitmask, ``apply_token_bitmask_inplace`` on CPU and CUDA logits, rows chosen by ``indices``), and vLLM and
SGLang both default to it. (Measured on this machine; see docs/openai.md.)

Where the work happens: a schema is compiled in a child process under a time and memory budget, off the
engine's admission path (``grammar_compile.py``: the request waits outside the scheduler until its grammar is
ready), and compiled grammars are cached by schema text; what the grammar cannot enforce is refused before
(``schema_check.py``). In the step, only the rows with a grammar fill their bitmask row (a C++ call each)
and are masked in one call; after sampling each such row's matcher accepts its token. A sequence whose
grammar is complete ends with "stop".
"""

from __future__ import annotations

from typing import Any

import torch


def available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


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
