#!/usr/bin/env python
"""A DeepSpeed-MII RESTful API client, to send the same requests DeepSpeed-MII's own multi-process REST
benchmark sends, to MII or to anything that answers like it.

Where the request comes from (DeepSpeed-MII, Apache-2.0, Copyright (c) Microsoft Corporation): the script in
the description of deepspeedai/DeepSpeed-MII pull request #328 ("Multi-process RESTful API", 2023-11-27)
starts one ``curl`` process per query, all at once::

    curl -X POST -H "Content-Type: application/json" \\
         -d '{"prompts": "<query>", "ignore_eos": true, "max_length": 128}' http://localhost:8000/mii/test-dep

and compares the time against ``client.generate(queries, ignore_eos=True, max_length=128)`` (summing each
response's ``generated_length``). The answer is what MII's REST gateway (``mii/grpc_related/restful_gateway.py``)
returns: a JSON list, one object per prompt, ``Response.to_msg_dict()``: ``generated_text``,
``prompt_length``, ``generated_length``, ``finish_reason``. The gateway before that PR returned
``json.dumps(...)`` through flask-restful, i.e. that list encoded once more as a JSON string; both are read.

This module is written from that description, not copied. ``max_length`` is MII's cap on prompt + generated
tokens (not new tokens).

    .venv/bin/python -m bench.generation.mii_rest_client http://127.0.0.1:28080/mii/test-dep
    .venv/bin/python -m bench.generation.mii_rest_client URL --max-length 128 \\
        --prompt "DeepSpeed is" --prompt "Seattle is"
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import urllib.request
from typing import Any

# The eight queries of the PR #328 script.
QUERIES = ["Hello world!", "My name is", "DeepSpeed is", "Seattle is", "One day", "I like to",
           "My favorite food is", "The world is"]  # fmt: skip


def request_body(prompt: str, max_length: int, ignore_eos: bool = True) -> bytes:
    """The body the benchmark sends: one prompt (a string, not a list), ``ignore_eos``, ``max_length``."""
    return json.dumps({"prompts": prompt, "ignore_eos": ignore_eos, "max_length": max_length}).encode()


def parse_response(raw: bytes | str) -> list[dict[str, Any]]:
    """The gateway's answer: a list of ``{generated_text, prompt_length, generated_length, finish_reason}``
    (possibly JSON-encoded twice, as the gateway before PR #328 sent it)."""
    data = json.loads(raw)
    if isinstance(data, str):
        data = json.loads(data)
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not all(isinstance(r, dict) and "generated_length" in r for r in data):
        raise ValueError(f"not a MII response list: {str(raw)[:300]!r}")
    return data


def call_mii_rest_curl(url: str, prompts: list[str], max_length: int) -> list[list[dict[str, Any]]]:
    """Like the PR #328 script: one ``curl`` process per prompt, all started at once, then wait for each."""

    def curl(prompt: str) -> list[str]:
        body = request_body(prompt, max_length).decode()
        return ["curl", "-s", "-X", "POST", "-H", "Content-Type: application/json", "-d", body, url]

    procs = [subprocess.Popen(curl(p), stdout=subprocess.PIPE, stderr=subprocess.PIPE) for p in prompts]
    results = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"curl exited {proc.returncode}: {err.decode(errors='replace').strip()}")
        results.append(parse_response(out))
    return results


def call_mii_rest(url: str, prompt: str, max_length: int, timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """The same request from Python (no curl), one at a time."""
    req = urllib.request.Request(url, data=request_body(prompt, max_length), method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return parse_response(resp.read())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="the deployment's REST address, e.g. http://127.0.0.1:28080/mii/NAME")
    parser.add_argument("--max-length", type=int, default=128, help="prompt + generated tokens (default 128)")
    parser.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable; default: PR #328's 8)")
    parser.add_argument("--sequential", action="store_true", help="one request at a time from Python, no curl")
    args = parser.parse_args(argv)
    prompts = args.prompt or QUERIES
    start = time.perf_counter()
    if args.sequential or shutil.which("curl") is None:
        results = [call_mii_rest(args.url, p, args.max_length) for p in prompts]
    else:
        results = call_mii_rest_curl(args.url, prompts, args.max_length)
    elapsed = time.perf_counter() - start
    tokens = 0
    for prompt, answer in zip(prompts, results, strict=True):
        for r in answer:
            tokens += int(r["generated_length"])
            print(f"{prompt!r}: {r['generated_length']} tokens ({r.get('finish_reason')}), prompt "
                  f"{r.get('prompt_length')}: {str(r.get('generated_text', ''))[:60]!r}")  # fmt: skip
    print(f"{len(prompts)} requests, {tokens} generated tokens in {elapsed:.2f} s: {tokens / elapsed:.1f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
