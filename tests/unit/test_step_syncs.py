"""A greedy step reads the device back once (the sampled tokens) and sends its inputs up in one copy. Counted
on a CPU, on the path a GPU takes (decodes as one padded batch, no C kernel, the step's host tensors packed
into one staging buffer as ``Uploader`` does for a device): every read of a tensor's values into Python
(``item``, ``bool``, ``int``: ``aten._local_scalar_dense``; ``tolist``, ``numpy``) and every copy between
devices. On a CPU all of them are cheap; on a GPU each read waits for everything queued before it."""

from __future__ import annotations

import copy

import pytest
import torch
from test_own_model import run, tiny
from test_step_core import expected, prompts
from torch.utils._python_dispatch import TorchDispatchMode

from zserve.generator.attention import Uploader
from zserve.generator.llama import own_model
from zserve.generator.sequence import SamplingParams
from zserve.generator.step_core import StepCore


class HostReads(TorchDispatchMode):
    """Counts the ops that make the host wait for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append("item")
        elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            dst = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device") or src.device
            if torch.device(dst) != src.device:
                self.reads.append(f"copy {src.device}->{dst}")
        return func(*args, **kwargs)


@pytest.fixture
def counted(monkeypatch):
    """Host reads in the dispatcher, plus ``tolist``/``numpy``, which read a tensor without dispatching."""
    mode = HostReads()
    for name in ("tolist", "numpy"):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, _original=original, _name=name, **kwargs):
            mode.reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    return mode


def steps_reads(engine: StepCore, mode: HostReads, steps: int) -> list[list[str]]:
    out = []
    for _ in range(steps):
        mode.reads = []
        with mode:
            engine.step()
        out.append(mode.reads)
    return out


def gpu_path_engine(model, **kwargs) -> StepCore:
    engine = StepCore(model, block_size=8, batched_decode=True, native_decode=False, **kwargs)
    engine.upload = Uploader(engine.device, pack=True)  # what a device does, on the CPU
    return engine


@pytest.mark.parametrize("family", ["llama-gqa-untied", "qwen3-gqa"])
def test_a_greedy_step_of_our_model_reads_the_device_once_and_uploads_once(counted, family):
    engine = gpu_path_engine(own_model(tiny(family), "zserve"), num_blocks=64, max_batched_tokens=64)
    for i, n in enumerate((5, 30, 70)):  # 70 > 64: a later chunk of a prompt beside decodes
        engine.add(i, list(range(1, n + 1)), SamplingParams(max_new_tokens=6))
    reads = []
    for steps in range(1, 7):
        counted.reads = []
        with counted:
            engine.step()
        reads.append(counted.reads)
        assert engine.upload.uploads == steps
    assert all(r == ["tolist"] for r in reads), reads  # the sampler's tokens, nothing else


@pytest.mark.parametrize("impl", ["zserve", "transformers"])
def test_the_packed_upload_keeps_greedy_equal_to_generate(impl):
    reference = tiny("qwen2-mha")
    engine = gpu_path_engine(own_model(copy.deepcopy(reference), impl), num_blocks=24, max_batched_tokens=48)
    batch = prompts(10, seed=4)
    produced = run(engine, batch, 10)
    assert engine.scheduler.preemptions > 0 and engine.upload.uploads == engine.stats.steps
    for i, prompt in enumerate(batch):
        assert produced[i] == expected(reference, prompt, 10), f"sequence {i}"


def test_the_counter_sees_reads_and_copies(counted):
    x = torch.arange(4)
    with counted:
        x.sum().item()
        bool(x[0])
        x.tolist()
        x.to("meta")
    assert counted.reads == ["item", "item", "tolist", "copy cpu->meta"]
