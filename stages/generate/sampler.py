"""Next-token sampling for a whole step, on the model's device, vectorised over the batch.

Greedy rows are one ``argmax``; sampled rows apply temperature, top-k and top-p with a few tensor ops for
all of them together and draw by inverse CDF with one uniform number per row. Only the chosen token ids
(B ints) are copied back to the host, never the logits.

Top-k/top-p need the most likely tokens in order. A full sort of a 49k vocabulary costs far more than the
rest of the sampler on a CPU, so the candidates come from ``topk`` of a few hundred first; that is exact
whenever those hold the top-p mass (they almost always do for a trained model), and it widens to a full
sort for the step where they do not.

Seeds: a row's uniform number is a hash of (seed, tokens it generated so far), so a seeded sequence draws
the same tokens whatever else is in the batch, and again after a preemption recomputes it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import torch

from zserve.stages.generate.sequence import Sequence

_CANDIDATES = (256, 4096)  # topk sizes tried before a full sort
_MASK = (1 << 64) - 1


def seeded_uniform(seed: int, counter: int) -> float:
    """A number in [0, 1) from (seed, counter): splitmix64, so that draws are independent per counter."""
    z = ((seed & _MASK) ^ ((counter + 1) * 0x9E3779B97F4A7C15)) & _MASK
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


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
        self._ban_early_stops(logits, seqs)
        sampled = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if not sampled:
            return logits.argmax(-1).tolist()  # the greedy fast path
        tokens = logits.argmax(-1)
        rows = [seqs[i] for i in sampled]
        index = torch.tensor(sampled, device=logits.device)
        tokens[index] = self._draw(logits.index_select(0, index), rows)
        return tokens.tolist()

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        device = logits.device
        params = [s.params for s in seqs]
        uniforms = [
            self._rng.random() if p.seed is None else seeded_uniform(p.seed, s.num_generated)
            for p, s in zip(params, seqs, strict=True)
        ]
        u = torch.tensor(uniforms, dtype=torch.float32, device=device)
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        x = logits.float() / temperature.unsqueeze(1)
        top_k = [p.top_k if 0 < p.top_k < self.vocab_size else 0 for p in params]
        top_p = [p.top_p for p in params]
        if not any(top_k) and all(p >= 1.0 for p in top_p):
            cdf = torch.softmax(x, -1).cumsum(-1)
            return _pick(cdf, u, None, x)
        k = torch.tensor(top_k, device=device)
        p = torch.tensor(top_p, dtype=torch.float32, device=device)
        log_z = torch.logsumexp(x, -1, keepdim=True)  # the full vocabulary's normaliser (rows without top-k)
        tries = [max(top_k)] if all(top_k) else [n for n in _CANDIDATES if n < x.shape[1]]
        for n in [*tries, x.shape[1]]:
            values, ids = torch.topk(x, n, -1) if n < x.shape[1] else torch.sort(x, -1, descending=True)
            position = torch.arange(n, device=device).unsqueeze(0)
            values = values.masked_fill((k > 0).unsqueeze(1) & (position >= k.unsqueeze(1)), float("-inf"))
            # top-k rows renormalise over their k tokens (as transformers' warpers do), the rest over all
            norm = torch.where((k > 0).unsqueeze(1), torch.logsumexp(values, -1, keepdim=True), log_z)
            probs = torch.exp(values - norm)
            cumulative = probs.cumsum(-1)
            covered = (k > 0) | (p >= 1.0) | (cumulative[:, -1] >= p)
            if n == x.shape[1] or bool(covered.all()):
                break
        keep = (cumulative - probs) <= p.unsqueeze(1)  # the first token past top_p stays
        cdf = torch.where(keep, probs, 0.0).cumsum(-1)
        return _pick(cdf, u, ids, x)


def _pick(cdf: torch.Tensor, u: torch.Tensor, ids: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first position whose cumulative weight passes u x total; a row whose weights
    vanished (nan, all zero) falls back to its argmax."""
    total = cdf[:, -1:]
    position = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True).clamp_(max=cdf.shape[1] - 1)
    chosen = position if ids is None else ids.gather(1, position)
    ok = (total > 0) & torch.isfinite(total)
    return torch.where(ok, chosen, x.argmax(-1, keepdim=True)).squeeze(1)
