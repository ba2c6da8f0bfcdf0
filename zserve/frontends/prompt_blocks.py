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

import msgspec

from zserve.batching.prefix_hash import shareable_hashes
from zserve.batching.routing import MAX_ROUTE_BLOCKS
from zserve.generation import GenerateRequest, tokenizer_fingerprint
from zserve.generator.options import GeneratorOptions

log = logging.getLogger("zserve.frontend")


class PromptBlocks:
    """``blocks(item)``: the hashes of the shareable prompt blocks of a decoded generative request; the item
    (a ``GenerateRequest`` the client has not encoded yet) gains its ``prompt_token_ids`` and ``prompt_tokenizer``."""

    def __init__(self, options: dict[str, Any]) -> None:
        """``options``: the model's ``[models.options]``; what is not given is ``GeneratorOptions``' default,
        as the engine reads it."""
        defaults = GeneratorOptions()
        self.path = str(options.get("path", defaults.path))
        self.gguf_file = str(options.get("gguf_file", defaults.gguf_file))
        self.block_size = int(options.get("block_size", defaults.block_size))
        self.enabled = bool(options.get("prefix_caching", defaults.prefix_caching)) and bool(self.path)
        self._tokenizer: Any = None
        self.fingerprint = ""  # set with the tokenizer; "" sends no ids (the engine tokenises)

    def start(self) -> PromptBlocks:
        """Load the tokenizer in the background (requests meanwhile are routed by load)."""
        if self.enabled:
            threading.Thread(target=self._load, name="prompt-blocks-tokenizer", daemon=True).start()
        return self

    def __call__(self, item: Any) -> list[int]:
        if self._tokenizer is None or not isinstance(item, GenerateRequest):
            return []
        try:
            ids = self.prompt_ids(item)
        except Exception as exc:  # the engine answers the request's own error; routing just has no blocks
            log.debug("no prompt blocks for routing: %r", exc)
            return []
        if self.fingerprint:
            item.prompt_token_ids = ids
            item.prompt_tokenizer = self.fingerprint
        return shareable_hashes(ids, self.block_size, MAX_ROUTE_BLOCKS)

    def prompt_ids(self, item: GenerateRequest) -> list[int]:
        """Token ids as ``Generator.prepare`` makes them (the chat template for ``messages``)."""
        tokenizer = self._tokenizer or self._load()
        if tokenizer is None:
            raise RuntimeError("no tokenizer")
        if item.messages is not None:
            text = tokenizer.apply_chat_template(
                [msgspec.to_builtins(m) for m in item.messages],
                tools=item.tools,
                tokenize=False,
                add_generation_prompt=True,
            )
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        return tokenizer(item.prompt)["input_ids"]

    def _load(self) -> Any:
        from transformers import AutoTokenizer

        from zserve.gguf_cache import config_path, resolve_model_path

        path = self.path
        try:
            path = resolve_model_path(self.path)
            if self.gguf_file:  # the engine's own tokenizer folder, made once from the file's metadata (read: ~10 s)
                path = str(config_path(path, self.gguf_file))
            tokenizer = AutoTokenizer.from_pretrained(path)
            self.fingerprint = tokenizer_fingerprint(tokenizer)
            self._tokenizer = tokenizer  # last: __call__ reads the fingerprint once it sees the tokenizer
            log.info("routing: tokenizer loaded from %s; requests carry their prompt blocks", path)
        except Exception as exc:
            self.enabled = False
            log.warning("cannot load the tokenizer at %s (%r): requests are routed by load only", path, exc)
        return self._tokenizer
