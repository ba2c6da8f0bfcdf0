"""The batch path of an embedding model on a GPU: bf16 against fp32, and zserve's engine path against the model's
forward alone (issue 24's GPU check). Random weights from a real config (BGE-base: BERT, 768 wide, 12 layers),
wrapped in a sentence-transformers stack (CLS pooling + Normalize), no download, a few minutes.

    python -m bench.gpu.embed_dtype                      # cuda, batches 32 and 128 of 32 and 256 tokens
    python -m bench.gpu.embed_dtype --device cpu --batch 8 --seq 32 --iters 3  # a smoke run anywhere

Per dtype and shape: items/s of (a) the transformers model's forward alone on device tensors, (b) the
sentence-transformers stack's forward on device tensors, (c) zserve's engine path: numpy arrays in (as they
arrive from a stage), pinned and copied without blocking, the stack, one copy of the vectors back to numpy
(``zserve.models.st_library.Forward`` when zserve imports here, else the same steps inline). (c)/(a) is what
serving costs over the forward; bf16/fp32 what the dtype buys; the cosine of bf16 to fp32 vectors its accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 30522,
    "max_position_embeddings": 512,
}  # fmt: skip  (--small: the test suite's dry run)
BGE_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
            "vocab_size": 30522, "max_position_embeddings": 512}  # fmt: skip


def build_stack(folder: Path, config: dict):
    # one path that sentence-transformers 6.0 (the GPU image's 6.0.1) and 6.2+ both have
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, BertTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10,
                            trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials))  # fmt: skip
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    BertTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                      sep_token="[SEP]").save_pretrained(folder)  # fmt: skip
    torch.manual_seed(0)
    BertModel(BertConfig(**config)).save_pretrained(folder)
    transformer = Transformer(str(folder))
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="cls")
    return SentenceTransformer(modules=[transformer, pooling, Normalize()])


def timed(fn, iters: int, sync) -> float:
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def engine_path(model, device: str, dtype: str):
    try:
        from zserve.models.st_library import Forward

        forward = Forward(model, device, dtype)
        return lambda features: forward.rows_to_host([list(range(len(features["input_ids"])))],
                                                     [forward(features)["sentence_embedding"]],
                                                     len(features["input_ids"]), lambda x: x), "zserve"  # fmt: skip
    except ImportError:
        model = model.to(device, getattr(torch, dtype)).eval()
        pinned = torch.device(device).type == "cuda"

        def run(features):
            inputs = {}
            for key, value in features.items():
                tensor = torch.from_numpy(np.array(value))
                inputs[key] = tensor.pin_memory().to(device, non_blocking=True) if pinned else tensor.to(device)
            with torch.inference_mode():
                return model(inputs)["sentence_embedding"].float().cpu().numpy()

        return run, "inline"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", default="32,128")
    parser.add_argument("--seq", default="32,256")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default="")
    parser.add_argument("--small", action="store_true", help="a 2-layer model instead of BGE-base (a dry run)")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device")
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    if args.device.startswith("cuda"):
        print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows, vectors = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "bfloat16"):
            stack = build_stack(Path(tmp) / dtype, SMALL if args.small else BGE_BASE)
            run, how = engine_path(stack, args.device, dtype)
            stack = stack.to(args.device, getattr(torch, dtype)).eval()
            bert = stack[0].auto_model
            for batch in map(int, args.batch.split(",")):
                for seq in map(int, args.seq.split(",")):
                    ids = np.random.default_rng(0).integers(4, 200, (batch, seq)).astype(np.int64)
                    host = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
                    dev = {k: torch.from_numpy(v).to(args.device) for k, v in host.items()}
                    with torch.inference_mode():
                        t_model = timed(lambda: bert(**dev), args.iters, sync)  # noqa: B023
                        t_stack = timed(lambda: stack(dict(dev)), args.iters, sync)  # noqa: B023
                    t_engine = timed(lambda: run(dict(host)), args.iters, sync)  # noqa: B023
                    vectors[(dtype, batch, seq)] = run(dict(host))
                    rows.append({"dtype": dtype, "batch": batch, "seq": seq, "path": how,
                                 "model_items_s": batch / t_model, "stack_items_s": batch / t_stack,
                                 "engine_items_s": batch / t_engine,
                                 "engine_vs_model": t_model / t_engine})  # fmt: skip
    print(f"{'dtype':9} {'batch':>5} {'seq':>4} {'model/s':>9} {'stack/s':>9} {'engine/s':>9} {'engine/model':>12}")
    for r in rows:
        print(f"{r['dtype']:9} {r['batch']:5} {r['seq']:4} {r['model_items_s']:9.0f} {r['stack_items_s']:9.0f} "
              f"{r['engine_items_s']:9.0f} {r['engine_vs_model']:12.2f}")  # fmt: skip
    for r in rows:
        if r["dtype"] == "bfloat16":
            fp32 = next(x for x in rows if x["dtype"] == "float32" and (x["batch"], x["seq"]) == (r["batch"], r["seq"]))
            a, b = vectors[("float32", r["batch"], r["seq"])], vectors[("bfloat16", r["batch"], r["seq"])]
            r["bf16_speedup"] = r["engine_items_s"] / fp32["engine_items_s"]
            r["min_cosine_to_fp32"] = float(
                ((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min()
            )
            print(f"bf16 batch {r['batch']} seq {r['seq']}: {r['bf16_speedup']:.2f}x fp32, min cosine "
                  f"{r['min_cosine_to_fp32']:.5f}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
