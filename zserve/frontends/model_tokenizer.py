"""A generative model's tokenizer in a frontend worker, loaded once from the engine's own files (the model's
folder, or the folder the engine made from a GGUF file's metadata), and the token ids the engine makes of a
request (``Generator.prepare``): what routing hashes (``prompt_blocks.py``) and ``POST /tokenize`` answers
(``tokenize_routes.py``).

One per model and worker, shared by both; it loads on first use, or when routing loads it on a thread of its own
as the worker starts (SmolLM2's GGUF: 13.6 s the first time, while the engine makes its folder).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import msgspec

from zserve.generation import ChatMessage, GenerateRequest, tokenizer_fingerprint
from zserve.generator.options import GeneratorOptions

log = logging.getLogger("zserve.frontend")


class ModelTokenizer:
    """``load()`` once (any thread), then ``text_ids``, ``chat_ids``, ``prompt_ids``; ``tokenizer`` is the
    transformers tokenizer itself once loaded."""

    def __init__(self, options: dict[str, Any]) -> None:
        """``options``: the model's ``[models.options]``; what is not given is ``GeneratorOptions``' default,
        as the engine reads it."""
        defaults = GeneratorOptions()
        self.path = str(options.get("path", defaults.path))
        self.gguf_file = str(options.get("gguf_file", defaults.gguf_file))
        self.tokenizer: Any = None
        self.fingerprint = ""  # set with the tokenizer
        self.max_context = 0  # the prompt + generated tokens the engine takes (its config's), set with it
        self.failed = "" if self.path else "the model has no `path` option"  # why it cannot load
        self.folder = ""  # where it loaded from
        self._lock = threading.Lock()

    def load(self) -> Any:
        """The tokenizer, loaded here by the first caller (the others wait for it); None if it cannot load
        (``failed`` says why)."""
        with self._lock:
            if self.tokenizer is None and not self.failed:
                self._load()
        return self.tokenizer

    def _load(self) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from zserve.gguf_cache import config_path, resolve_model_path

        path = self.path
        try:
            path = resolve_model_path(self.path)
            if self.gguf_file:  # the engine's own tokenizer folder, made once from the file's metadata
                path = str(config_path(path, self.gguf_file))
            tokenizer = AutoTokenizer.from_pretrained(path)
            config = AutoConfig.from_pretrained(path)
        except Exception as exc:
            self.failed = f"cannot load the tokenizer at {path} ({exc!r})"
            log.warning("%s: /tokenize answers 500 and requests are routed by load", self.failed)
            return
        # as Generator.max_context reads it
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.folder = path
        self.tokenizer = tokenizer  # last: readers that see the tokenizer see the rest

    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's ids, as ``/v1/completions`` takes it: the tokenizer's special tokens around it by default."""
        return self._loaded()(text, add_special_tokens=add_special_tokens)["input_ids"]

    def chat_ids(
        self,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Rendered with the chat template, then tokenised; the template writes the special tokens itself."""
        tokenizer = self._loaded()
        text = tokenizer.apply_chat_template(
            [msgspec.to_builtins(m) for m in messages],
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def prompt_ids(self, item: GenerateRequest) -> list[int]:
        """Token ids as ``Generator.prepare`` makes them (the chat template for ``messages``)."""
        if item.messages is not None:
            return self.chat_ids(item.messages, tools=item.tools)
        return self.text_ids(item.prompt or "")

    def _loaded(self) -> Any:
        tokenizer = self.tokenizer or self.load()
        if tokenizer is None:
            raise RuntimeError(self.failed)
        return tokenizer
