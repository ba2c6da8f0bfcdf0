"""Next-token sampling for a whole step, on the model's device, vectorised over the batch.

Greedy rows are one ``argmax``; sampled rows apply temperature, top-k and top-p with a few tensor ops for
all of them together and draw by inverse CDF with one uniform number per row. Only the chosen token ids
(B ints) are copied back to the host, never the logits.

A full sort of a 49k vocabulary costs far more than the rest of the sampler on a CPU (~30 ms for 8 rows on
one thread), so top-k takes ``topk(k)`` candidates and top-p samples by rejection (``_nucleus``): both
exact, neither sorts. (Taking the top-p nucleus from the top 256 logits first was tried: SmolLM2 at
temperature 1 spreads 0.9 of its mass over more than 256 tokens for 96% of the rows of the benchmark.)

Before any of that, in this order (as vLLM v1 does): the log-probabilities a row asked for are taken from the
model's raw logits (``log_softmax``: what OpenAI's ``logprobs`` report, unaffected by the options below);
eos and stop ids are banned until ``min_new_tokens``; ``logit_bias`` is added (one ``index_put_`` for every
biased row); the penalties are applied to the rows that have them, together, on the entries they change:
each row's seen tokens with their counts among the generated ones (kept per sequence, a step's new token
added each step) are gathered in one call; frequency subtracts ``f x count``, presence ``p x (count > 0)``,
repetition (over prompt and generated tokens, HF's formula) divides positive logits by ``r`` and multiplies
negative ones; the results are written back in one ``index_put_``; then the tokens a row's grammar forbids
are banned (only rows with a grammar, ``grammar.py``). A step without any of these options runs none of it.

The sampled ids and, when asked for, their log-probabilities and the top-k alternatives come back to the
host in one copy (one float64 tensor: token ids are exact in it).

Seeds: a row's uniform number is a hash of (seed, tokens it generated so far), so a seeded sequence draws
the same tokens whatever else is in the batch, and again after a preemption recomputes it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from zserve.generator import grammar, native_pointwise
from zserve.generator.sequence import Sequence

_DRAWS = 16  # rejection rounds of top-p per token (then the rows still drawing are sorted)
_MASK = (1 << 64) - 1


def seeded_uniform(seed: int, counter: int) -> float:
    """A number in [0, 1) from (seed, counter): splitmix64, so that draws are independent per counter."""
    z = ((seed & _MASK) ^ ((counter + 1) * 0x9E3779B97F4A7C15)) & _MASK
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


@dataclass(slots=True)
class TokenLogprobs:
    """A sampled token's log-probability under the model, and the ``k`` most likely tokens' (id, logprob)."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class Sampled:
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; empty when no row asked


class Sampler:
    def __init__(self, eos_ids: Iterable[int], vocab_size: int) -> None:
        self.eos_ids = tuple(t for t in eos_ids if 0 <= t < vocab_size)
        self.vocab_size = vocab_size
        self._rng = random.Random()  # unseeded rows

    def _ban_early_stops(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> None:
        """eos and stop ids cannot be sampled before ``min_new_tokens``: their logits become -inf."""
        rows: list[int] = []
        cols: list[int] = []
        for i, seq in enumerate(seqs):
            p = seq.params
            if seq.num_generated < p.min_new_tokens:
                banned = {t for t in (*self.eos_ids, *p.stop_token_ids) if t < logits.shape[1]}
                rows += [i] * len(banned)
                cols += banned
        if rows:
            index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
            logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device, dtype=logits.dtype))

    def sample(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> list[int]:
        """One token per row of ``logits`` [rows, vocab] (row i belongs to ``seqs[i]``)."""
        return self.run(logits, seqs).tokens

    def run(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> Sampled:
        """One token per row, and the log-probabilities of the rows that asked for them. ``logits`` is
        changed in place."""
        wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs >= 0]
        raw = torch.log_softmax(logits[_index(wanted, logits.device)].float(), -1) if wanted else None
        self._ban_early_stops(logits, seqs)
        self._bias(logits, seqs)
        self._penalise(logits, seqs)
        constrained = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
        if constrained:
            grammar.mask(logits, constrained, [seqs[i].matcher for i in constrained])
        tokens = self._tokens(logits, seqs)
        if raw is None:
            return Sampled(tokens.tolist(), [])
        return self._with_logprobs(tokens, raw, wanted, seqs)

    def _tokens(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        sampled = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if not sampled:
            return _argmax(logits)  # the greedy fast path
        if len(sampled) == len(seqs):
            return self._draw(logits, list(seqs))
        tokens = _argmax(logits)
        index = torch.tensor(sampled, device=logits.device)
        tokens[index] = self._draw(logits.index_select(0, index), [seqs[i] for i in sampled])
        return tokens

    def _with_logprobs(
        self, tokens: torch.Tensor, raw: torch.Tensor, wanted: list[int], seqs: Seq[Sequence]
    ) -> Sampled:
        """The tokens, and for the ``wanted`` rows (``raw``: their log-softmax) the chosen token's logprob and the
        top k, all in one copy to the host."""
        rows = _index(wanted, tokens.device)
        host, found = _logprobs_to_host(raw, tokens[rows], [seqs[i].params.logprobs for i in wanted], tokens)
        logprobs: list[TokenLogprobs | None] = [None] * len(tokens)
        for i, row in zip(wanted, found, strict=True):
            logprobs[i] = row
        return Sampled([int(t) for t in host], logprobs)

    def _bias(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> None:
        """``logit_bias``: every biased row's additions in one ``index_put_``. Each sequence's (ids, values)
        reach the device once, the first time it is sampled; a step only concatenates them."""
        rows: list[int] = []
        ids: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for i, seq in enumerate(seqs):
            if not seq.params.logit_bias:
                continue
            if seq.bias is None or seq.bias[0].device != logits.device:
                tokens, biases = zip(*seq.params.logit_bias, strict=True)
                seq.bias = (_index(list(tokens), logits.device),
                            torch.tensor(biases, dtype=torch.float32, device=logits.device))  # fmt: skip
            rows.append(i)
            ids.append(seq.bias[0])
            values.append(seq.bias[1])
        if not rows:
            return
        counts = torch.tensor([len(t) for t in ids], device=logits.device)
        index = (_index(rows, logits.device).repeat_interleave(counts), torch.cat(ids))
        logits.index_put_(index, torch.cat(values).to(logits.dtype), accumulate=True)

    def _penalise(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> None:
        """Presence, frequency and repetition penalties for every penalised row at once (vLLM's formulas),
        on the (row, token) entries they change only: each row's seen tokens with their counts, gathered,
        changed and written back in one call each (a dense [rows, vocab] pass per operation cost ~3 ms a
        step at 8 rows of a 49k vocabulary on 2 CPU threads)."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.penalised]
        if not rows:
            return
        device = logits.device
        params = [seqs[i].params for i in rows]
        row_of, tokens, counts, sizes = [], [], [], []
        for i in rows:
            seen = _seen(seqs[i])
            row_of += [i] * len(seen)
            tokens += seen.keys()
            counts += seen.values()
            sizes.append(len(seen))
        index = (_index(row_of, device), _index(tokens, device))
        x = logits[index].float()
        c = torch.tensor(counts, dtype=torch.float32, device=device)
        repeats = torch.tensor(sizes, device=device)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device).repeat_interleave(repeats)
        presence = torch.tensor([p.presence_penalty for p in params], device=device).repeat_interleave(repeats)
        x -= frequency * c + presence * (c > 0)
        if any(p.repetition_penalty != 1.0 for p in params):  # every entry of such a row is seen (prompt or output)
            r = torch.tensor([p.repetition_penalty for p in params], device=device).repeat_interleave(repeats)
            x = torch.where(x > 0, x / r, x * r)
        logits.index_put_(index, x.to(logits.dtype))

    def _uniforms(self, seqs: Seq[Sequence], draw: int, device: torch.device) -> torch.Tensor:
        """One number in [0, 1) per sequence: its ``draw``-th of this step (seeded: a function of the seed and
        the tokens generated so far, nothing else)."""
        values = [
            self._rng.random()
            if s.params.seed is None
            else seeded_uniform(s.params.seed, s.num_generated * _DRAWS + draw)
            for s in seqs
        ]
        return torch.tensor(values, dtype=torch.float32, device=device)

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Sampled rows: temperature, then top-k (from ``topk`` candidates), then top-p; rows are grouped by
        what they need, and each group costs a few passes over its rows only."""
        device = logits.device
        params = [s.params for s in seqs]
        u = self._uniforms(seqs, 0, device)
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        x = logits.float() / temperature.unsqueeze(1)
        vocab = x.shape[1]
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        top_p = [p.top_p for p in params]
        out = torch.empty(len(seqs), dtype=torch.long, device=device)
        plain = [i for i in range(len(seqs)) if not top_k[i] and top_p[i] >= 1.0]
        ranked = [i for i in range(len(seqs)) if top_k[i]]
        nucleus = [i for i in range(len(seqs)) if not top_k[i] and top_p[i] < 1.0]
        if plain:
            rows = _index(plain, device)
            out[rows] = _pick(torch.softmax(x[rows], -1).cumsum(-1), u[rows], None, x[rows])
        if ranked:  # exact from the top max(k) candidates
            rows = _index(ranked, device)
            k = torch.tensor([top_k[i] for i in ranked], device=device)
            p = torch.tensor([top_p[i] for i in ranked], dtype=torch.float32, device=device)
            values, ids = torch.topk(x[rows], max(top_k[i] for i in ranked), -1)
            position = torch.arange(values.shape[1], device=device).unsqueeze(0)
            values = values.masked_fill(position >= k.unsqueeze(1), float("-inf"))
            out[rows] = _nucleus_of_candidates(
                values, ids, torch.logsumexp(values, -1, keepdim=True), p, u[rows], x[rows]
            )
        if nucleus:
            rows = _index(nucleus, device)
            p = torch.tensor([top_p[i] for i in nucleus], dtype=torch.float32, device=device)
            out[rows] = self._nucleus(x[rows], p, u[rows], [seqs[i] for i in nucleus])
        return out

    def _nucleus(self, x: torch.Tensor, p: torch.Tensor, u: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Top-p without top-k, by rejection (as FlashInfer's sampler does; no sort): draw from the tokens
        more likely than a pivot (at first, all of them); the token is in the nucleus iff the tokens strictly
        more likely than it hold at most ``p`` of the mass, then it is the answer; else it becomes the pivot
        and the row draws again. Accepted draws follow the nucleus distribution exactly; each round is a few
        passes over the rows still drawing, and most rows accept in the first one or two."""
        probs = torch.softmax(x, -1)
        out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        active = torch.arange(x.shape[0], device=x.device)
        pivot = torch.zeros(x.shape[0], 1, device=x.device)
        for draw in range(1, _DRAWS):
            rows = probs[active]
            weights = torch.where(rows > pivot, rows, 0.0)
            token = _pick(weights.cumsum(-1), u, None, rows)
            q = rows.gather(1, token.unsqueeze(1))
            above = torch.where(rows > q, rows, 0.0).sum(-1)
            accept = above <= p[active]
            out[active[accept]] = token[accept]
            if bool(accept.all()):
                return out
            active, pivot = active[~accept], q[~accept]
            u = self._uniforms([seqs[i] for i in active.tolist()], draw, x.device)
        values, ids = torch.sort(x[active], -1, descending=True)  # rows still drawing: rare, exact anyway
        log_z = torch.logsumexp(values, -1, keepdim=True)
        out[active] = _nucleus_of_candidates(values, ids, log_z, p[active], u, x[active])
        return out


def prompt_logprobs(logits: torch.Tensor, targets: list[int], top: list[int]) -> list[TokenLogprobs]:
    """Per row of ``logits`` the log-probability of its ``targets`` token and its ``top`` most likely tokens'
    (prompt logprobs: a prompt position's logits and the prompt's next token), in one copy to the host."""
    raw = torch.log_softmax(logits.float(), -1)
    return _logprobs_to_host(raw, _index(targets, raw.device), top)[1]


def _logprobs_to_host(
    raw: torch.Tensor, chosen_ids: torch.Tensor, top: list[int], head: torch.Tensor | None = None
) -> tuple[list[float], list[TokenLogprobs]]:
    """Row r of ``raw`` (log-softmax): the logprob of token ``chosen_ids[r]`` and the ``top[r]`` best, with
    ``head`` (the step's sampled ids) in the same single copy: (head's values, one TokenLogprobs per row)."""
    chosen = raw.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)
    k = max(top)
    top_values, top_ids = torch.topk(raw, k, -1) if k else (raw[:, :0], raw[:, :0])
    parts = [chosen.double(), top_values.double().flatten(), top_ids.double().flatten()]
    host = torch.cat(parts if head is None else [head.double(), *parts]).tolist()  # token ids are exact in float64
    n = 0 if head is None else len(head)
    w = len(top)
    values, ids = host[n + w : n + w + w * k], host[n + w + w * k :]
    rows = [
        TokenLogprobs(host[n + j], [(int(ids[j * k + r]), values[j * k + r]) for r in range(top[j])]) for j in range(w)
    ]
    return host[:n], rows


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _seen(seq: Sequence) -> dict[int, int]:
    """The tokens a penalty touches in ``seq``, each with its count among the generated tokens: the
    generated ones, and under a repetition penalty the prompt's too (count 0 unless also generated).
    Brought up to date with the tokens added since the last step only."""
    seen = seq.seen
    if seq.seen_upto < 0:
        if seq.params.repetition_penalty != 1.0:
            seen.update(dict.fromkeys(seq.tokens[: seq.prompt_len], 0))
        seq.seen_upto = seq.prompt_len
    for token in seq.tokens[seq.seen_upto :]:
        seen[token] = seen.get(token, 0) + 1
    seq.seen_upto = len(seq.tokens)
    return seen


def _nucleus_of_candidates(
    values: torch.Tensor, ids: torch.Tensor, norm: torch.Tensor, p: torch.Tensor, u: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """Top-p over candidates sorted by logit (``values``, vocabulary ``ids``), probabilities ``exp(values -
    norm)``: keep each token while the mass before it is at most p (the token that crosses p stays)."""
    probs = torch.exp(values - norm)
    keep = (probs.cumsum(-1) - probs) <= p.unsqueeze(1)
    return _pick(torch.where(keep, probs, 0.0).cumsum(-1), u, ids, x)


def _pick(cdf: torch.Tensor, u: torch.Tensor, ids: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first position whose cumulative weight passes u x total; a row whose weights
    vanished (nan, all zero) falls back to its argmax."""
    total = cdf[:, -1:]
    position = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True).clamp_(max=cdf.shape[1] - 1)
    chosen = (position if ids is None else ids.gather(1, position)).squeeze(1)
    ok = ((total > 0) & torch.isfinite(total)).squeeze(1)
    if bool(ok.all()):
        return chosen
    return torch.where(ok, chosen, x.argmax(-1))


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``, through the C kernel on a CPU in fp32 (0.25x torch's time over SmolLM2's 49k
    vocabulary: ``native_pointwise.py``)."""
    if logits.dim() == 2 and native_pointwise.applies(logits):
        return native_pointwise.argmax(logits)
    return logits.argmax(-1)
