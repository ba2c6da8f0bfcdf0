"""``cpu_linear = "auto"`` for real: a model's products timed on this CPU, the fastest kept per shape and row
bucket, the same results as ``nn.Linear``, the choice cached on disk and read back on the next start, and
oneDNN where our kernel cannot be built."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from zserve.generator import c_build, cpu_linear, kernel_choice, kernel_tune, native_linear


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ZSERVE_CACHE_DIR", str(tmp_path))
    native_linear._library.cache_clear()
    yield tmp_path
    native_linear._library.cache_clear()


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_auto_times_the_candidates_keeps_the_results_and_caches_the_choice(cache, caplog):
    model, ids = _model(), torch.randint(0, 256, (1, 12))
    with torch.inference_mode():
        want = model(ids).logits
        with caplog.at_level("INFO", logger="zserve.engine"):  # a budget a loaded CI machine can keep
            assert kernel_tune.prepack(model, rows=(1, 4, 16, 64), head_rows=16, budget_s=60) == 2 * 7 + 1
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU linear products")]
    assert len(lines) == 1 and "vs oneDNN's" in lines[0] and "cached" not in lines[0], lines
    packed = [m for m in model.modules() if isinstance(m, cpu_linear.PackedLinear)]
    assert all(m.route.rows == (1, 4, 16, 64) for m in packed if m.out_features != 256)
    assert all(m.route.rows == (1, 4, 16) for m in packed if m.out_features == 256)  # the lm_head: up to head_rows
    assert list(cache.glob("kernels/linear-choice-*.json"))

    again = _model()
    caplog.clear()
    with caplog.at_level("INFO", logger="zserve.engine"):
        cpu_linear.prepack(again, "auto", rows=(1, 4, 16, 64), head_rows=16)
    assert [r.getMessage() for r in caplog.records if "(choice cached)" in r.getMessage()]
    routes = [m.route for m in again.modules() if isinstance(m, cpu_linear.PackedLinear)]
    assert routes == [m.route for m in packed]


def test_the_measurement_times_every_candidate_at_every_bucket(cache):
    layers = [nn.Linear(64, 96) for _ in range(3)]
    timings = kernel_tune.measure({"64->96+b": layers}, {"64->96+b": (1, 8, 64)}, budget_s=30)
    names = set(kernel_tune.candidates(layers[0].weight))
    assert set(timings["64->96+b"]) == {1, 8, 64}
    for cell in timings["64->96+b"].values():
        assert set(cell) == names
        assert all(t is not None and t > 0 for t in cell.values())


def test_without_our_kernel_auto_chooses_between_onednn_and_torch(cache, monkeypatch):
    monkeypatch.setenv("CC", shutil.which("false") or "false")  # every build fails
    layer = nn.Linear(64, 96)
    assert kernel_tune.candidates(layer.weight) == [kernel_choice.ONEDNN, kernel_choice.TORCH]
    model = nn.Sequential(layer)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        want = model(x)
        cpu_linear.prepack(model, "auto", rows=(1, 8))
        assert set(model[0].route.kinds) <= {kernel_choice.ONEDNN, kernel_choice.TORCH}
        torch.testing.assert_close(model(x), want, rtol=1e-4, atol=1e-4)


def test_out_of_time_the_rest_runs_on_onednn_and_the_choice_is_not_cached(cache, monkeypatch, caplog):
    """A machine far busier than its cores: past the budget and its grace nothing more is measured, those
    buckets run oneDNN, and the next start measures again rather than keeping a choice made blind."""
    monkeypatch.setattr(kernel_tune, "_GRACE_S", 0.0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64))
    with caplog.at_level("INFO", logger="zserve.engine"), torch.inference_mode():
        kernel_tune.prepack(model, rows=(1, 8, 64), budget_s=0.0)
    assert "out of time" in caplog.text
    for layer in model:
        assert layer.route.kinds == (kernel_choice.ONEDNN,) * 3  # nothing measured within a budget of 0 s
    assert not list(cache.glob("kernels/linear-choice-*.json"))


def _cache_index(root, name: str, level: int, size: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "level").write_text(f"{level}\n")
    (root / name / "size").write_text(f"{size}\n")


def test_the_last_level_cache_is_read_from_sysfs(tmp_path):
    _cache_index(tmp_path, "index0", 1, "32K")
    _cache_index(tmp_path, "index2", 2, "1024K")
    _cache_index(tmp_path, "index3", 3, "32768K")
    assert kernel_tune.last_level_cache_bytes(str(tmp_path)) == 32 << 20
    _cache_index(tmp_path, "index4", 4, "1G")
    assert kernel_tune.last_level_cache_bytes(str(tmp_path)) == 1 << 30
    assert kernel_tune.last_level_cache_bytes(str(tmp_path / "absent")) == kernel_tune._L3_DEFAULT_BYTES


def test_few_rows_are_timed_on_more_weights_than_the_cache_holds(monkeypatch):
    """A decode step reads its weights from memory: the timed pass covers 1.5x the last-level cache of the
    shape's layers where it has that many, and where it has fewer, each pass starts after a flush."""
    assert kernel_tune._FEW_ROWS >= 32  # max_running's usual 32 decodes are timed streaming too
    layers = [nn.Linear(256, 256, bias=False) for _ in range(40)]  # 256 KiB each
    assert len(kernel_tune._streamed(layers, 3 << 20)) == 12  # 3 MiB of them
    assert len(kernel_tune._streamed(layers, 64 << 20)) == 40  # all there are
    [cut] = kernel_tune._streamed(layers[:1], 96 << 10)
    assert cut.out_features == 96 and cut.weight.data_ptr() == layers[0].weight.data_ptr()  # columns of one

    flushes = []
    monkeypatch.setattr(kernel_tune._Flush, "__call__", lambda self: flushes.append(self.size))
    monkeypatch.setattr(kernel_tune, "last_level_cache_bytes", lambda: 8 << 20)
    small = [nn.Linear(64, 96) for _ in range(3)]  # 72 KiB in all: fewer than the cache holds
    kernel_tune.measure({"64->96+b": small}, {"64->96+b": (1, 32, 128)}, budget_s=30)
    candidates = len(kernel_tune.candidates(small[0].weight))
    assert flushes and set(flushes) == {12 << 20}  # 1.5x the cache
    assert len(flushes) >= 2 * candidates  # every timed pass at 1 and 32 rows, none at 128 (compute-bound)
    assert len(flushes) <= 2 * candidates * kernel_tune._REPEATS


def test_a_quantised_shape_is_timed_on_a_bounded_sample_and_measured_once_for_every_width(monkeypatch):
    monkeypatch.delenv(kernel_tune.QUANT_ACTIVATIONS_ENV, raising=False)
    width = c_build.ISAS["portable"].width
    for n, k in [(32000, 576), (2048, 8192), (4096, 14336), (64, 96), (100_000, 32)]:
        out = kernel_tune.quant_sample_outputs(n, k, "portable")
        assert out % width == 0 and out <= min(n, kernel_tune._QUANT_SAMPLE_OUTPUTS)
        # the work of a timing stays bounded as K grows (the weights timed: outputs x inputs)
        assert out * k <= max(kernel_tune._QUANT_SAMPLE_WEIGHTS, kernel_tune._QUANT_MIN_OUTPUTS * k)
    if not c_build.has_compiler():
        return
    isa = c_build.isa().name
    kernel_tune._measured_quant.cache_clear()
    choices = {kernel_tune.quant_choice(n, 96, 8, False, True, isa) for n in (2048, 8192, 32000)}
    assert len(choices) == 1 and kernel_tune._measured_quant.cache_info().misses == 1  # one sample of 1536 outputs
