"""A routed generative model's prompt, tokenised in the frontend the way its engine tokenises it, down to the
hashes of its prefix blocks (``zserve.batching.prefix_hash``): what the broker's router matches against its
engines' caches (``Submit.block_hashes_packed``).

Why here: the broker must know a request's blocks before it routes, and its one loop must not tokenise; a
frontend worker has the request's decoded body anyway, and there are as many of them as the deployment wants.
The tokenizer loads on a thread of its own when the frontend worker starts (from the model's folder, or a GGUF
file's metadata: 13.6 s for SmolLM2's); until it is there, and whenever anything goes wrong (no tokenizer, a
body the engine will refuse), a request has no blocks: it is routed by load, and the engine answers its error.

Cost per request in the frontend (SmolLM2's tokenizer, 2-core EPYC shared with other work, best of 5 x 20):
a 37-token chat 96 us to tokenise + 15 us to hash; a 1,130-token chat 2.4 ms + 0.25 ms.

The ids travel with the request (``GenerateRequest.prompt_token_ids``, with the tokenizer's fingerprint,
``zserve.generation.tokenizer_fingerprint``), so the engine does not tokenise again: it takes them when the
fingerprint is its own, and tokenises the text itself when it is not (a frontend and an engine of other
releases or model revisions). That moves the tokenising off the engine's link thread, where it shares the
interpreter with the step loop, onto the frontend workers, which scale apart.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from zserve.batching.prefix_hash import shareable_hashes
from zserve.batching.routing import MAX_ROUTE_BLOCKS
from zserve.frontends.model_tokenizer import ModelTokenizer
from zserve.generation import GenerateRequest
from zserve.generator.options import GeneratorOptions

log = logging.getLogger("zserve.frontend")


class PromptBlocks:
    """``blocks(item)``: the hashes of the shareable prompt blocks of a decoded generative request; the item
    (a ``GenerateRequest`` the client has not encoded yet) gains its ``prompt_token_ids`` and ``prompt_tokenizer``."""

    def __init__(self, options: dict[str, Any], tokenizer: ModelTokenizer | None = None) -> None:
        """``options``: the model's ``[models.options]``; what is not given is ``GeneratorOptions``' default,
        as the engine reads it. ``tokenizer``: the model's, shared with the worker's other users of it."""
        defaults = GeneratorOptions()
        self.tokenizer = tokenizer or ModelTokenizer(options)
        self.block_size = int(options.get("block_size", defaults.block_size))
        self.enabled = bool(options.get("prefix_caching", defaults.prefix_caching)) and not self.tokenizer.failed

    def start(self) -> PromptBlocks:
        """Load the tokenizer in the background (requests meanwhile are routed by load)."""
        if self.enabled:
            threading.Thread(target=self._load, name="prompt-blocks-tokenizer", daemon=True).start()
        return self

    def __call__(self, item: Any) -> list[int]:
        tokenizer = self.tokenizer
        if not self.enabled or tokenizer.tokenizer is None or not isinstance(item, GenerateRequest):
            return []
        try:
            ids = tokenizer.prompt_ids(item)
        except Exception as exc:  # the engine answers the request's own error; routing just has no blocks
            log.debug("no prompt blocks for routing: %r", exc)
            return []
        if tokenizer.fingerprint:
            item.prompt_token_ids = ids
            item.prompt_tokenizer = tokenizer.fingerprint
        return shareable_hashes(ids, self.block_size, MAX_ROUTE_BLOCKS)

    def _load(self) -> None:
        if self.tokenizer.load() is None:
            self.enabled = False  # ModelTokenizer said why
        else:
            log.info("routing: tokenizer loaded from %s; requests carry their prompt blocks", self.tokenizer.folder)
