"""The batched sampler: greedy rows are argmax, sampled rows follow temperature/top-k exactly (against a
plain full-sort reference with the same uniform numbers) and top-p draws only from the nucleus with its
renormalised probabilities, and a seeded row draws the same token whatever else is in the batch."""

from __future__ import annotations

import random

import pytest
import torch

from zserve.generator.sampler import _DRAWS, Sampler, seeded_uniform
from zserve.generator.sequence import SamplingParams, Sequence


def seq(params: SamplingParams, generated: int = 0, seq_id: int = 0) -> Sequence:
    s = Sequence(seq_id, [1, 2, 3], params)
    s.tokens += [4] * generated
    return s


def nucleus(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """The tokens top-p keeps (by a full sort)."""
    probs, ids = torch.sort(torch.softmax(logits.double() / p.temperature, -1), descending=True)
    return set(ids[(probs.cumsum(-1) - probs) <= p.top_p].tolist())


def reference(logits: torch.Tensor, p: SamplingParams, u: float) -> int:
    """One row the slow, obvious way: full sort, top-k, renormalise, top-p, inverse CDF (over the sorted
    tokens; in vocabulary order without a filter)."""
    x = logits.double() / p.temperature
    values, ids = torch.sort(x, descending=True)
    if p.top_k:
        values = values[: p.top_k]
        ids = ids[: p.top_k]
    probs = torch.softmax(values, -1)
    cumulative = probs.cumsum(-1)
    keep = cumulative - probs <= p.top_p
    if not p.top_k and p.top_p >= 1:  # no filter: drawn in vocabulary order
        ids = ids.sort().values
        probs = torch.softmax(x, -1)[ids]
    else:
        probs, ids = probs[keep], ids[keep]
    cdf = probs.cumsum(-1)
    return int(ids[min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), len(ids) - 1)])


@pytest.mark.parametrize("vocab", [50, 5000])  # 5000: the top-p mass is past the first candidates
def test_sampled_rows_match_a_full_sort_reference(vocab):
    torch.manual_seed(0)
    sampler = Sampler([], vocab)
    cases = [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_p=0.9, seed=2),
        SamplingParams(temperature=1.3, top_k=20, seed=3),
        SamplingParams(temperature=1.0, top_k=40, top_p=0.5, seed=4),
        SamplingParams(temperature=2.0, top_p=0.95, seed=5),
    ]
    logits = torch.randn(len(cases), vocab) * (0.3 if vocab > 1000 else 3.0)  # flat: top-p needs many tokens
    for generated in range(20):
        rows = [seq(p, generated, i) for i, p in enumerate(cases)]
        got = sampler.sample(logits.clone(), rows)
        for i, p in enumerate(cases):
            if p.top_p < 1 and not p.top_k:  # by rejection: whatever it draws is in the nucleus
                assert got[i] in nucleus(logits[i], p)
            else:
                assert got[i] == reference(logits[i], p, seeded_uniform(p.seed, generated * _DRAWS))


def test_greedy_rows_and_the_degenerate_filters_are_argmax():
    torch.manual_seed(1)
    logits = torch.randn(4, 300)
    sampler = Sampler([], 300)
    rows = [
        seq(SamplingParams()),
        seq(SamplingParams(temperature=1.0, top_k=1, seed=1)),
        seq(SamplingParams(temperature=1.0, top_p=1e-6, seed=2)),
        seq(SamplingParams(temperature=1e-30, seed=3)),
    ]
    assert sampler.sample(logits.clone(), rows) == logits.argmax(-1).tolist()


def test_a_seeded_row_draws_the_same_whatever_the_batch():
    torch.manual_seed(2)
    vocab = 1000
    sampler = Sampler([], vocab)
    mine = SamplingParams(temperature=0.9, top_p=0.9, seed=42)
    row = torch.randn(vocab)
    alone = [sampler.sample(row.unsqueeze(0).clone(), [seq(mine, g)])[0] for g in range(30)]
    rng = random.Random(0)
    for _ in range(5):
        others = [
            SamplingParams(
                temperature=rng.choice([0.0, 0.5, 1.5]), top_k=rng.choice([0, 5, 200]), seed=rng.choice([None, 7])
            )
            for _ in range(rng.randrange(1, 8))
        ]
        at = rng.randrange(len(others) + 1)
        params = [*others[:at], mine, *others[at:]]
        logits = torch.randn(len(params), vocab)
        logits[at] = row
        batched = [sampler.sample(logits.clone(), [seq(p, g) for p in params])[at] for g in range(30)]
        assert batched == alone
    assert len(set(alone)) > 1  # it does sample


def test_unseeded_draws_follow_the_distribution_and_filters_hold():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    sampler = Sampler([], 4)
    n = 4000
    params = SamplingParams(temperature=1.0)
    draws = sampler.sample(logits.repeat(n, 1), [seq(params) for _ in range(n)])
    freq = [draws.count(t) / n for t in range(4)]
    assert all(abs(f - p) < 0.04 for f, p in zip(freq, [0.4, 0.3, 0.2, 0.1], strict=True)), freq
    top_p = sampler.sample(logits.repeat(n, 1), [seq(SamplingParams(temperature=1.0, top_p=0.5)) for _ in range(n)])
    assert set(top_p) == {0, 1}  # 0.4 < 0.5, so the token that crosses it (0.3) stays, nothing after
    assert abs(top_p.count(0) / n - 0.4 / 0.7) < 0.04  # renormalised over the nucleus
    top_k = sampler.sample(logits.repeat(n, 1), [seq(SamplingParams(temperature=1.0, top_k=3)) for _ in range(n)])
    assert set(top_k) == {0, 1, 2}


def test_min_new_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 10.0, 9.0, 1.0]])  # eos (1) then a stop id (2) are the most likely
    sampler = Sampler([1], 4)
    early = SamplingParams(min_new_tokens=3, stop_token_ids=(2,))
    assert sampler.sample(logits.clone(), [seq(early, 0)]) == [3]
    assert sampler.sample(logits.clone(), [seq(early, 3)]) == [1]


def _processed(sampler: Sampler, logits: torch.Tensor, rows: list[Sequence]) -> torch.Tensor:
    """The logits after bias and penalties (what the draw sees)."""
    x = logits.clone()
    sampler._bias(x, rows)
    sampler._penalise(x, rows)
    return x


def test_each_penalty_changes_exactly_the_logits_it_should():
    torch.manual_seed(3)
    vocab = 12
    logits = torch.randn(1, vocab) * 3
    sampler = Sampler([], vocab)

    def row(**options) -> Sequence:
        s = Sequence(0, [1, 2, 2], SamplingParams(**options))  # the prompt
        s.tokens += [5, 5, 7]  # generated
        return s

    counts = torch.zeros(vocab)
    counts[5], counts[7] = 2, 1
    got = _processed(sampler, logits, [row(frequency_penalty=0.5)])
    assert torch.allclose(got[0], logits[0] - 0.5 * counts)
    got = _processed(sampler, logits, [row(presence_penalty=-1.5)])
    assert torch.allclose(got[0], logits[0] + 1.5 * (counts > 0))
    from transformers import RepetitionPenaltyLogitsProcessor  # HF's formula over prompt + generated

    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[1, 2, 2, 5, 5, 7]]), logits.clone())
    got = _processed(sampler, logits, [row(repetition_penalty=1.3)])
    assert torch.allclose(got, expected)
    changed = (got[0] != logits[0]).nonzero().flatten().tolist()
    assert set(changed) <= {1, 2, 5, 7}
    got = _processed(sampler, logits, [row(logit_bias=((3, 100.0), (5, -2.0)))])
    delta = torch.zeros(vocab)
    delta[3], delta[5] = 100.0, -2.0
    assert torch.allclose(got[0], logits[0] + delta)
    assert sampler.sample(logits.clone(), [row(logit_bias=((3, 100.0),))]) == [3]  # greedy sees the bias
    assert torch.equal(_processed(sampler, logits, [row()]), logits)  # no option: untouched


def test_penalised_rows_in_a_batch_equal_each_row_alone():
    torch.manual_seed(4)
    vocab = 300
    sampler = Sampler([], vocab)
    options = [
        {},
        {"frequency_penalty": 1.0, "presence_penalty": 0.5},
        {"repetition_penalty": 1.2, "temperature": 0.8, "seed": 3},
        {"logit_bias": ((7, 5.0),), "temperature": 1.0, "top_k": 10, "seed": 4},
        {"presence_penalty": 2.0, "repetition_penalty": 0.9},
    ]
    rng = random.Random(5)
    rows = []
    for i, o in enumerate(options):
        s = Sequence(i, [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))], SamplingParams(**o))
        s.tokens += [rng.randrange(vocab) for _ in range(rng.randrange(0, 15))]
        rows.append(s)
    logits = torch.randn(len(rows), vocab)
    together = _processed(sampler, logits, rows)
    for i, s in enumerate(rows):
        assert torch.allclose(together[i], _processed(sampler, logits[i : i + 1], [s])[0])
    assert torch.equal(together[0], logits[0])
    drawn = sampler.sample(logits.clone(), rows)
    assert drawn == [sampler.sample(logits[i : i + 1].clone(), [s])[0] for i, s in enumerate(rows)]


def test_logprobs_are_the_raw_log_softmax_with_the_top_k():
    torch.manual_seed(6)
    vocab = 500
    sampler = Sampler([], vocab)
    logits = torch.randn(4, vocab) * 2
    rows = [
        seq(SamplingParams(logprobs=5, temperature=0.7, seed=1, frequency_penalty=1.0), 3, 0),
        seq(SamplingParams(), 0, 1),
        seq(SamplingParams(logprobs=0), 0, 2),
        seq(SamplingParams(logprobs=20, logit_bias=((9, 50.0),)), 0, 3),
    ]
    out = sampler.run(logits.clone(), rows)
    reference = torch.log_softmax(logits.double(), -1)
    assert out.logprobs[1] is None and out.tokens[3] == 9  # the bias decides, the logprob stays the model's
    for i, k in ((0, 5), (2, 0), (3, 20)):
        lp = out.logprobs[i]
        assert abs(lp.logprob - float(reference[i, out.tokens[i]])) < 1e-5
        values, ids = torch.topk(reference[i], k)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert all(abs(v - float(w)) < 1e-5 for (_, v), w in zip(lp.top, values, strict=True))
    assert out.tokens[2] == int(logits[2].argmax())
    plain = sampler.run(logits[1:2].clone(), [rows[1]])
    assert plain.logprobs == [] and plain.tokens == [int(logits[1].argmax())]
