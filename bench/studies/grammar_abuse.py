#!/usr/bin/env python
"""Issue 40's engine-side figures, in process: what a thread ticking every 10 ms (standing in for the engine's
heartbeat thread) sees during the first structured request and during a costly tool's compile, the old way
(xgrammar's tokenizer info and the compile on the request's thread) and through ``GrammarService`` (info
built at engine start, compiles in a budgeted child process); and stop matching's cost per token with 800
long stops, the old full rescan (kept in tests/unit/test_stop_matching.py) against ``StopMatcher``.

The tokenizer is a synthetic byte-level BPE of SmolLM2's size (49,152 tokens, built here: nothing is
downloaded). The old way's 5,000-property compile is not run (670 s of one core on this tokenizer, and its
serialisation took over 20 GB): ``--old-costly`` times it with a 64-property schema of the same shape.

    .venv/bin/python -m bench.studies.grammar_abuse
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import report
from bench.common.paths import RESULTS


def synthetic_tokenizer(out: Path, size: int = 49152) -> Any:
    """A byte-level BPE of ``size`` tokens whose merges join random earlier tokens (xgrammar's setup cost
    depends on the vocabulary, not on what the tokens mean)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({ch: i + 3 for i, ch in enumerate(alphabet)})
    rng, tokens, merges = random.Random(0), list(alphabet), []
    while len(vocab) < size:
        a = rng.choice(tokens[-2000:] if len(tokens) > 3000 and rng.random() < 0.5 else tokens)
        b = rng.choice(tokens[:300])
        if a + b in vocab or len(a + b) > 16:
            continue
        vocab[a + b] = len(vocab)
        tokens.append(a + b)
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def ticking(work: Callable[[], Any]) -> tuple[Any, float, float]:
    """(work's result or exception, its seconds, the longest gap in seconds between a 10 ms ticker's ticks)."""
    stop, gaps = threading.Event(), [0.0]

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    started = time.perf_counter()
    try:
        result = work()
    except Exception as exc:  # a refusal is a result here
        result = exc
    took = time.perf_counter() - started
    stop.set()
    ticker.join()
    return result, took, max(gaps)


def optional_properties(n: int) -> str:
    return json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}})


def stop_costs() -> dict[str, float]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "unit"))
    from test_stop_matching import RescanStream

    from zserve.generator.detokenize import TextStream

    stops = [f"{i:05d}" + "a" * 495 for i in range(800)]  # 800 stops of 500 characters
    pieces = ["00799"] + ["a" * 4] * 120  # held back the whole time as a prefix of the last one

    def per_token(make: Callable[[], Any], reps: int) -> float:
        best = float("inf")
        for _ in range(reps):
            stream, started = make(), time.perf_counter()
            for p in pieces:
                stream.push_text(p)
            best = min(best, (time.perf_counter() - started) / len(pieces))
        return best

    return {
        "rescan_s": per_token(lambda: RescanStream(stops), 1),
        "matcher_s": per_token(lambda: TextStream(None, stops), 5),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--costly", type=int, default=5000, help="optional properties of the costly tool")
    parser.add_argument("--old-costly", type=int, default=64, help="the same shape, timed the old way")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import xgrammar as xgr

    from zserve.generator.grammar_compile import CompileBudget, GrammarService

    tok = synthetic_tokenizer(Path(tempfile.mkdtemp()))
    rows: dict[str, Any] = {"vocab": len(tok)}

    def old_first() -> Any:
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
        compiler = xgr.GrammarCompiler(info, max_threads=1)
        return compiler, compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)

    (compiler, _), took, gap = ticking(old_first)
    rows["old_first_request"] = {"s": took, "max_gap_s": gap}
    _, took, gap = ticking(
        lambda: compiler.compile_json_schema(optional_properties(args.old_costly), any_whitespace=False)
    )
    rows["old_costly"] = {"properties": args.old_costly, "s": took, "max_gap_s": gap}
    service, took, gap = ticking(lambda: GrammarService(tok, len(tok), CompileBudget()))
    rows["engine_start"] = {"s": took, "max_gap_s": gap}
    service.compile(json.dumps({"type": "string"}))  # the child is ready, as long after an engine's start
    _, took, gap = ticking(lambda: service.compile(None))
    rows["new_first_request"] = {"s": took, "max_gap_s": gap}
    refused, took, gap = ticking(lambda: service.compile(optional_properties(args.costly), "tools"))
    rows["new_costly"] = {"properties": args.costly, "s": took, "max_gap_s": gap, "answer": str(refused)}
    service.close()
    rows["stops"] = stop_costs()
    print(f"vocabulary {rows['vocab']}; a 10 ms ticker's longest gap (the heartbeat thread's view)")
    print(f"first json_object request, old: {rows['old_first_request']['s'] * 1e3:.0f} ms, gap "
          f"{rows['old_first_request']['max_gap_s'] * 1e3:.0f} ms; now: {rows['new_first_request']['s'] * 1e3:.0f} ms, "
          f"gap {rows['new_first_request']['max_gap_s'] * 1e3:.0f} ms (engine start {rows['engine_start']['s']:.1f} s, "
          f"gap {rows['engine_start']['max_gap_s'] * 1e3:.0f} ms, before it registers)")  # fmt: skip
    print(f"{args.old_costly}-property tool compiled the old way: {rows['old_costly']['s']:.2f} s on the request's "
          f"thread (admission held that long), gap {rows['old_costly']['max_gap_s'] * 1e3:.0f} ms")  # fmt: skip
    print(f"{args.costly}-property tool now: answered in {rows['new_costly']['s']:.1f} s ({refused}), gap "
          f"{rows['new_costly']['max_gap_s'] * 1e3:.0f} ms, admission never held")  # fmt: skip
    print(f"800 stops of 500 chars: rescan {rows['stops']['rescan_s'] * 1e3:.1f} ms/token, "
          f"matcher {rows['stops']['matcher_s'] * 1e6:.1f} us/token")  # fmt: skip
    out = args.out or RESULTS / time.strftime("grammar-abuse-%Y%m%d-%H%M%S.json")
    report.write_json(out, {"revision": report.git_revision(), **rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
