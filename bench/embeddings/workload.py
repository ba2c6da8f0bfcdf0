"""The two workloads, as request texts and as a wrk Lua script that picks a body per request.

* ``short``: one fixed 16-word sentence (bench/common/catalog.py's ``SENTENCE``), every request the same;
* ``mixed``: a seeded list of ``MIXED_SIZE`` texts, 80% of 10-30 tokens and 20% of 200-400 tokens (counted with
  the model's own tokenizer, special tokens excluded). The Lua script picks one at random per request with a fixed
  seed, so every target sees the same distribution. The model truncates at its ``max_seq_length`` (256 for
  all-MiniLM-L6-v2) on every target alike.

Texts are made of whole-word tokens drawn from the model's ``vocab.txt`` (lowercase letters, 3+ characters), so a
text of N words is N tokens; each is checked with the tokenizer and trimmed to its drawn length.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from bench.common.catalog import SENTENCE
from bench.common.loadgen import _LUA, _MARK

SHORT, MIXED = "short", "mixed"
WORKLOADS = (SHORT, MIXED)
MIXED_SIZE = 400
SEED = 24  # issue 24
SHORT_TOKENS = (10, 30)
LONG_TOKENS = (200, 400)
LONG_SHARE = 0.2

# loadgen's done() prints one JSON line that loadgen.run_wrk parses; reuse it as is.
_DONE = _LUA[_LUA.index("done = function") :] % {"mark": _MARK}

_SCRIPT = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local bodies = {
%(bodies)s
}
math.randomseed(%(seed)d)
request = function()
  return wrk.format(nil, nil, nil, bodies[math.random(#bodies)])
end

"""


def _vocab_words(model_dir: Path) -> list[str]:
    words = []
    for line in (model_dir / "vocab.txt").read_text().splitlines():
        if len(line) >= 3 and line.isascii() and line.isalpha() and line.islower():
            words.append(line)
    return words


def texts(workload: str, model_dir: Path) -> list[str]:
    """The request texts of a workload (``short``: one)."""
    if workload == SHORT:
        return [SENTENCE]
    if workload != MIXED:
        raise ValueError(f"unknown workload {workload!r} (known: {', '.join(WORKLOADS)})")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    words = _vocab_words(model_dir)
    rng = random.Random(SEED)
    out = []
    for _ in range(MIXED_SIZE):
        low, high = LONG_TOKENS if rng.random() < LONG_SHARE else SHORT_TOKENS
        n = rng.randint(low, high)
        drawn = [rng.choice(words) for _ in range(n + 8)]
        # Trim to exactly n tokens (a vocab word is one token; the check guards against surprises).
        ids = tokenizer(" ".join(drawn), add_special_tokens=False)["input_ids"][:n]
        text = tokenizer.decode(ids)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) != n:
            raise RuntimeError(f"mixed workload: a drawn text does not tokenize to {n} tokens")
        out.append(text)
    return out


def token_counts(workload_texts: list[str], model_dir: Path) -> list[int]:
    """Tokens per text as the model sees them: special tokens included, truncated at the model's max length."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    max_length = max_seq_length(model_dir)
    ids = tokenizer(workload_texts, truncation=True, max_length=max_length)["input_ids"]
    return [len(x) for x in ids]


def max_seq_length(model_dir: Path) -> int:
    """sentence-transformers' max_seq_length (what zserve's handler and infinity's torch engine truncate at)."""
    path = model_dir / "sentence_bert_config.json"
    if path.is_file():
        return int(json.loads(path.read_text()).get("max_seq_length", 256))
    return 256


def body(name: str, text: str) -> bytes:
    """The OpenAI-shaped request body every target takes."""
    return json.dumps({"model": name, "input": text}, separators=(",", ":")).encode()


def write_lua(path: Path, bodies: list[bytes]) -> Path:
    """A wrk script: each request's body picked at random (fixed seed) from ``bodies``; loadgen's JSON report."""
    rows = []
    for b in bodies:
        text = b.decode()
        if "]==]" in text:
            raise ValueError("a request body contains ']==]', which ends the Lua long string")
        rows.append(f"  [==[{text}]==],")
    path.write_text(_SCRIPT % {"bodies": "\n".join(rows), "seed": SEED} + _DONE)
    return path


def describe(workload_texts: list[str], model_dir: Path) -> dict[str, Any]:
    counts = token_counts(workload_texts, model_dir)
    counts_sorted = sorted(counts)
    return {
        "texts": len(workload_texts),
        "tokens_min": counts_sorted[0],
        "tokens_median": counts_sorted[len(counts_sorted) // 2],
        "tokens_max": counts_sorted[-1],
        "tokens_mean": sum(counts) / len(counts),
        "max_seq_length": max_seq_length(model_dir),
    }
