"""The OpenAI shapes of generated tokens' logprobs: chat's ``logprobs.content`` and the legacy completions'
parallel lists, for a whole answer and for a streamed chunk's tokens."""

from __future__ import annotations

from zserve.frontends.api_types import ChatLogprobs, CompletionLogprobs, TokenLogprobOut, TopLogprobOut
from zserve.generation import GenerateResponse, PromptLogprob, TokenLogprob


def chat(tokens: list[TokenLogprob] | None) -> ChatLogprobs | None:
    if tokens is None:
        return None
    return ChatLogprobs([
        TokenLogprobOut(t.token, t.logprob, list(t.token.encode()),
                        [TopLogprobOut(a.token, a.logprob, list(a.token.encode())) for a in t.top_logprobs])
        for t in tokens
    ])  # fmt: skip


def completion(response: GenerateResponse, offset: int) -> CompletionLogprobs:
    """The choice's logprobs; its generated text starts at ``offset`` of the choice's text (after the echoed
    prompt, whose tokens come first when the response has their logprobs)."""
    return completion_of(response.prompt_logprobs or [], response.logprobs or [], offset)


def completion_of(prompt: list[PromptLogprob], tokens: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    """The legacy shape of ``prompt``'s logprobs (from offset 0), then ``tokens``' (from ``offset``)."""
    out = CompletionLogprobs([], [], [], [])
    prompt_offset = 0
    for p in prompt:
        out.tokens.append(p.token)
        out.token_logprobs.append(p.logprob)
        out.top_logprobs.append(None if p.logprob is None else {a.token: a.logprob for a in p.top_logprobs})
        out.text_offset.append(prompt_offset)
        prompt_offset += len(p.token)
    for t in tokens:
        out.tokens.append(t.token)
        out.token_logprobs.append(t.logprob)
        out.top_logprobs.append({a.token: a.logprob for a in t.top_logprobs})
        out.text_offset.append(offset)
        offset += len(t.token)
    return out
