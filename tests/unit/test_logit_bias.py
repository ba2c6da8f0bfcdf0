"""logit_bias prepared once per sequence as device tensors (ids, values) and applied to every biased row of a
step in one index_put_: the same logits as adding each row's bias by hand, the tensors made on the first
step only."""

from __future__ import annotations

import torch

from zserve.generator.sampler import Sampler
from zserve.generator.sequence import SamplingParams, Sequence


def test_bias_is_prepared_once_and_applied_to_its_rows_only() -> None:
    torch.manual_seed(0)
    vocab = 50
    sampler = Sampler([], vocab)
    biases = [((3, 5.0), (7, -100.0), (49, 0.5)), (), ((0, 2.0),), ((3, -1.0), (4, 1.0))]
    seqs = [Sequence(i, [1, 2], SamplingParams(logit_bias=b)) for i, b in enumerate(biases)]
    prepared = None
    for _ in range(3):
        logits = torch.randn(len(seqs), vocab)
        expected = logits.clone()
        for row, b in enumerate(biases):
            for token, value in b:
                expected[row, token] += value
        sampler._bias(logits, seqs)
        assert torch.allclose(logits, expected)
        made = [s.bias for s in seqs]
        if prepared is None:
            prepared = made
            assert made[1] is None  # an unbiased row gets nothing
            assert made[0][0].tolist() == [3, 7, 49] and made[0][1].tolist() == [5.0, -100.0, 0.5]
        else:  # the very tensors of the first step: nothing rebuilt from the Python lists
            assert all(a is b for a, b in zip(made, prepared, strict=True))
    assert sampler.sample(torch.zeros(1, vocab), [Sequence(9, [1], SamplingParams(logit_bias=((11, 9.0),)))]) == [11]
