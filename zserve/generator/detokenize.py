"""Incremental detokenisation and stop strings, outside the engine's step loop.

``TextStream.push(token_id)`` returns the new text, correct across multi-byte characters (a token that
ends inside a UTF-8 sequence yields nothing until the character is complete). With stop strings, text
that could be the start of one is held back until it is known not to be; when one appears, the text up to
it is released and ``stopped`` is set."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = (), *, prompt_ids: list[int] | None = None):
        # transformers' fast tokenizers wrap a `tokenizers.Tokenizer`; DecodeStream needs that one.
        self._tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._stream = DecodeStream(skip_special_tokens=True)
        if prompt_ids:  # context, so the first generated token decodes as it would after the prompt
            self._stream = DecodeStream(prompt_ids, skip_special_tokens=True)
        self.stop = [s for s in stop if s]
        self._held = ""
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        piece = self._stream.step(self._tokenizer, token_id) or ""
        return self._release(self._held + piece)

    def advance(self, token_id: int, finish_reason: str | None) -> tuple[str, str | None]:
        """Push one generated token: (new text, why the sequence ends now, or None). A stop string ends it
        with "stop" (``stopped`` is set: the caller must abort it in the engine); the engine's own reason
        (eos, stop id, length) releases whatever is held back."""
        delta = self.push(token_id)
        if self.stopped:
            return delta, "stop"
        if finish_reason:
            return delta + self.flush(), finish_reason
        return delta, None

    def flush(self) -> str:
        """At the end of generation: whatever is still held back."""
        if self.stopped:
            return ""
        text, self._held = self._held, ""
        self.text += text
        return text

    def _release(self, pending: str) -> str:
        for s in self.stop:
            at = pending.find(s)
            if at >= 0:
                self.stopped = True
                self._held = ""
                self.text += pending[:at]
                return pending[:at]
        keep = 0
        for s in self.stop:  # the longest tail of `pending` that is a prefix of a stop string
            for n in range(min(len(s) - 1, len(pending)), keep, -1):
                if s.startswith(pending[-n:]):
                    keep = n
                    break
        out, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.text += out
        return out
