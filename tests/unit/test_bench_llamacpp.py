"""The llama-server comparison's pure parts (bench/generation/vs_llamacpp.py): its options, llama-server's command
line, the request counts per caller, issue 36's served targets and the table. Building or running llama-server
is the benchmark's job (`make bench-llama-server`), never a test's."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.generation import vs_llamacpp
from bench.generation.workload import GenRow


def row(leg: str, c: int, threads: int, tok_s: float, tpot_ms: float, ttft_ms: float = 100.0) -> GenRow:
    return GenRow("mixed", leg, c, c, int(tok_s), 1.0, tok_s, ttft_ms, ttft_ms, tpot_ms, tpot_ms,
                  detail={"threads": threads, "rss_mb": 150.0})  # fmt: skip


def test_defaults_are_the_issue_grid() -> None:
    args = vs_llamacpp.parse_args([])
    assert (args.concurrency, args.threads, args.servers) == ([1, 8, 32], [1, 2], ["llama", "zserve"])
    assert args.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf" and args.quantization == "auto"
    assert len(args.requests) == len(args.concurrency)


def test_one_request_count_serves_every_concurrency_and_a_wrong_count_is_refused() -> None:
    assert vs_llamacpp.parse_args(["--concurrency", "1,8", "--requests", "8"]).requests == [8, 8]
    with pytest.raises(SystemExit):
        vs_llamacpp.parse_args(["--concurrency", "1,8,32", "--requests", "8,16"])
    with pytest.raises(SystemExit):
        vs_llamacpp.parse_args(["--servers", "ollama"])


def test_every_caller_sends_whole_rounds() -> None:
    assert [vs_llamacpp.per_caller(n, c) for n, c in [(6, 1), (16, 8), (32, 32), (10, 8), (4, 32)]] == [6, 2, 1, 2, 1]


def test_llama_server_gets_a_slot_per_caller_and_zserves_threads() -> None:
    argv = vs_llamacpp.llama_server_argv(Path("/opt/llama-server"), Path("/m/x.gguf"), 8123, 8, 2, 400)
    flags = {a: b for a, b in zip(argv[1:], [*argv[2:], ""], strict=True) if a.startswith("--")}
    assert argv[0] == "/opt/llama-server" and flags["--cont-batching"].startswith("--")
    assert flags["--model"] == "/m/x.gguf" and flags["--host"] == "127.0.0.1" and flags["--port"] == "8123"
    # -c is shared by the slots: each of the 8 gets 400 tokens
    assert (flags["--parallel"], flags["--ctx-size"]) == ("8", "3200")
    assert (flags["--threads"], flags["--threads-batch"]) == ("2", "2")


def test_targets_met_missed_and_the_peer_of_each_leg() -> None:
    rows = [
        row("llama-server-1t", 1, 1, 100.0, 10.0),
        row("zserve-1t", 1, 1, 85.0, 11.0),  # 0.85x: met at c1 (>= 0.8x), TPOT not judged below c8
        row("llama-server-1t", 8, 1, 200.0, 30.0),
        row("zserve-1t", 8, 1, 190.0, 29.0),  # 0.95x: missed; TPOT below the peer's: met
        row("llama-server-2t", 8, 2, 300.0, 20.0),
        row("zserve-2t", 8, 2, 330.0, 21.0),  # met; TPOT above: missed
        row("zserve-2t", 32, 2, 500.0, 40.0),  # no peer leg: not judged
    ]
    targets = {t.name: t.met for t in vs_llamacpp.evaluate(rows)}
    assert targets == {"tok-s-c1-1t": True, "tok-s-c8-1t": False, "tpot-c8-1t": True, "tok-s-c8-2t": True,
                       "tpot-c8-2t": False}  # fmt: skip
    table = vs_llamacpp.format_table(rows)
    assert "0.85" in table and "1.10" in table
    lines = table.splitlines()
    # each peer's row comes before zserve's at the same threads and concurrency
    assert lines.index(next(x for x in lines if "llama-server-2t" in x)) < lines.index(
        next(x for x in lines if "zserve-2t" in x)
    )
