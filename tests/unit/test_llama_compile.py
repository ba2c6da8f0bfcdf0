"""llama.py's leaf functions are torch.compile-d on CUDA through ``Compiled``: a compile that fails (here a real
one: inductor with no working C++ compiler) leaves that leaf eager, with a warning, and the step's output
unchanged. On the CPU the suite runs, compiling needs minutes, so only the failure path is run here."""

from __future__ import annotations

import logging

import torch
import torch._inductor.config as inductor_config

from zserve.generator import llama


def test_a_leaf_whose_compile_fails_runs_eagerly_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(inductor_config.cpp, "cxx", ("/nonexistent/cc",))
    leaf = llama.Compiled(llama.silu_mul)
    x = torch.randn(5, 64)
    with caplog.at_level(logging.WARNING, logger="zserve.generator.llama"):
        assert torch.equal(leaf(x), llama.silu_mul(x))
    assert leaf.failed and "torch.compile of silu_mul failed" in caplog.text
    assert torch.equal(leaf(x[:2]), llama.silu_mul(x[:2]))  # eager from now on, without compiling again
    assert "silu_mul" not in llama.COMPILE_S
    assert torch._dynamo.config.recompile_limit >= llama.RECOMPILE_LIMIT  # no cliff at dynamo's default of 8
