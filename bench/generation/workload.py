"""The generation benchmark's workload and bookkeeping: seeded requests whose prompts tokenise to exactly
the drawn length, the closed loop that sends them, and one table row from the timings.

Every leg gets the same requests: caller ``k`` of a scenario at concurrency ``c`` sends ``pool[k]``,
``pool[c + k]``, ``pool[2c + k]``, ... so round ``j`` of the scenario is ``pool[j*c : (j+1)*c]``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.common.measure import percentile

# Plain words: every one is at least one token, so a text of n words has at least n tokens.
WORDS = (
    "the of and to in is was for that with as on by at from his her they this which you be are or an had "
    "not but what all were when we there can more one about time some would other into has two like them "
    "then than first water been call who now find long down day did get come made may part over new sound "
    "take only little work know place year live back give most very after thing our just name good sentence "
    "man think say great where help through much before line right too mean old any same tell boy follow came "
    "want show also around form three small set put end does another well large must big even such because "
    "turn here why ask went men read need land different home us move try kind hand picture again change off "
    "play spell air away animal house point page letter mother answer found study still learn should world"
).split()


@dataclass(slots=True)
class GenRequest:
    prompt_text: str
    prompt_ids: list[int]  # the tokeniser's ids for prompt_text (what every leg feeds the model)
    output_len: int  # tokens to generate (ignore_eos: exactly this many)


def text_of_length(tokenizer: Any, n: int, rng: random.Random) -> str:
    """Random words whose tokenisation (``tokenizer(text)``, special tokens included, as the engine does it)
    is exactly ``n`` ids long."""
    specials = len(tokenizer("")["input_ids"])
    want = n - specials
    if want < 1:
        raise ValueError(f"a prompt of {n} tokens leaves no room after {specials} special tokens")
    for _ in range(200):
        words = " ".join(rng.choice(WORDS) for _ in range(want + 4))
        ids = tokenizer(words, add_special_tokens=False)["input_ids"][:want]
        text = tokenizer.decode(ids)
        if len(tokenizer(text)["input_ids"]) == n:
            return text
    raise RuntimeError(f"could not build a text of exactly {n} tokens with this tokenizer")


def build_pool(
    tokenizer: Any, size: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int]
) -> list[GenRequest]:
    """``size`` requests with uniformly drawn prompt and output lengths (both ranges inclusive)."""
    rng = random.Random(seed)
    pool = []
    for _ in range(size):
        n_prompt = rng.randint(*prompt_range)
        n_output = rng.randint(*output_range)
        text = text_of_length(tokenizer, n_prompt, rng)
        pool.append(GenRequest(text, tokenizer(text)["input_ids"], n_output))
    return pool


def uniform_batch(tokenizer: Any, batch: int, prompt_len: int, output_len: int, seed: int) -> list[GenRequest]:
    rng = random.Random(seed + 1)
    texts = [text_of_length(tokenizer, prompt_len, rng) for _ in range(batch)]
    return [GenRequest(t, tokenizer(t)["input_ids"], output_len) for t in texts]


def schedule(pool: list[GenRequest], concurrency: int, per_caller: int) -> list[list[GenRequest]]:
    """What each caller sends, in order (see the module docstring)."""
    if concurrency * per_caller > len(pool):
        raise ValueError(f"the pool has {len(pool)} requests; c{concurrency} x {per_caller} needs more")
    return [[pool[j * concurrency + k] for j in range(per_caller)] for k in range(concurrency)]


@dataclass(slots=True)
class Timing:
    """One answered request, in ``time.perf_counter()`` seconds."""

    start_s: float  # the caller sent it
    first_s: float  # its first token was there (end of the step that produced it)
    last_s: float  # its last token was there
    tokens: int  # tokens it generated

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        return (self.last_s - self.first_s) / (self.tokens - 1) if self.tokens > 1 else None


# call(request, deadline) -> Timing, or None when the request was not started before the deadline
Call = Callable[[GenRequest, float | None], Timing | None]


def closed_loop(call: Call, callers: list[list[GenRequest]], duration_s: float | None = None) -> tuple[list, float]:
    """Each caller sends its requests one after another. With ``duration_s`` callers cycle through theirs
    and stop starting new ones at the deadline. Returns the timings and the wall time (first send to last
    answer). The first error stops the scenario and is raised."""
    timings: list[Timing] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    started = time.perf_counter()
    deadline = started + duration_s if duration_s else None

    def caller(requests: list[GenRequest]) -> None:
        index = 0
        while not errors and (index < len(requests) if deadline is None else time.perf_counter() < deadline):
            try:
                timing = call(requests[index % len(requests)], deadline)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
                return
            if timing is None:
                return
            with lock:
                timings.append(timing)
            index += 1

    threads = [threading.Thread(target=caller, args=(r,), daemon=True) for r in callers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    ended = max((t.last_s for t in timings), default=time.perf_counter())
    return timings, ended - started


@dataclass
class GenRow:
    scenario: str  # "mixed" (the closed loop)
    leg: str  # zserve | static | single
    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    vs_static: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(leg: str, concurrency: int, timings: list[Timing], wall_s: float, **detail: Any) -> GenRow:
    ttft = sorted(t.ttft_s * 1000 for t in timings)
    tpot = sorted(t.tpot_s * 1000 for t in timings if t.tpot_s is not None)
    tokens = sum(t.tokens for t in timings)
    return GenRow(
        "mixed", leg, concurrency, len(timings), tokens, wall_s, tokens / wall_s if wall_s > 0 else 0.0,
        percentile(ttft, 50), percentile(ttft, 99), percentile(tpot, 50), percentile(tpot, 99), detail=detail,
    )  # fmt: skip
