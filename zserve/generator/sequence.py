"""A generation request inside the engine: its tokens, sampling parameters and progress."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zserve.generator.block_manager import SeqBlocks

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0  # eos and stop ids cannot be sampled before this many tokens
    # OpenAI's penalties (over the generated tokens) and HF's repetition penalty (prompt and generated tokens)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off; logits of seen tokens: positive / r, negative * r
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int = -1  # -1: none; k >= 0: the sampled token's log-probability and the k most likely
    prompt_logprobs: int = -1  # likewise for each prompt token after the first (its prefix is then not shared)
    grammar: Any = None  # an xgrammar CompiledGrammar the output must follow (grammar.py)

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        # below this, logits / temperature overflows: it is greedy anyway
        return self.temperature < 1e-5


@dataclass(slots=True)
class Sequence:
    seq_id: int  # the caller's id (the runner's batch id, generate's prompt index)
    tokens: list[int]
    params: SamplingParams
    prompt_len: int = 0
    num_computed: int = 0  # tokens whose KV is in the cache
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    kv: SeqBlocks = field(init=False)
    # the engine's slot tables (torch tensors, filled block by block as the block table grows; see
    # StepCore._sync): every KV slot of the sequence, and its block table
    slots: torch.Tensor | None = None
    table: torch.Tensor | None = None
    matcher: Any = None  # the grammar's state after the generated tokens (params.grammar's GrammarMatcher)
    # params.prompt_logprobs >= 0: entry p for prompt token p + 1, filled as the prompt's chunks are computed
    prompt_logprobs: list[Any] = field(default_factory=list)
    # penalised sequences (sampler.py): how often each generated token occurs (prompt tokens with 0 under a
    # repetition penalty), kept up to date a step at a time instead of recounted every step
    seen: dict[int, int] = field(default_factory=dict)
    seen_upto: int = -1  # tokens counted into `seen` (-1: not started)
    # params.logit_bias as (token ids, values) on the model's device, made the first time the row is sampled
    # (sampler.py) so a step does not rebuild them from Python lists
    bias: tuple[torch.Tensor, torch.Tensor] | None = None
    priority: int = 0  # lower is more urgent (the request's, from the broker)
    # the scheduler's order, set when it is added: (arrival + priority * aging, arrival order); lower goes first
    rank: tuple[float, int] = (0.0, 0)

    def __post_init__(self) -> None:
        self.prompt_len = self.prompt_len or len(self.tokens)
        # shares the token list; a prompt whose logprobs are asked is computed whole (no cached prefix)
        self.kv = SeqBlocks(self.seq_id, self.tokens, reuse_prefix=self.params.prompt_logprobs < 0)

    @property
    def prompt_logprobs_todo(self) -> bool:
        """Prompt positions whose logprobs are still to be computed."""
        return self.params.prompt_logprobs >= 0 and len(self.prompt_logprobs) < self.prompt_len - 1

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]
