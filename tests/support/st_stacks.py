"""sentence-transformers folders for the parity tests: tiny encoders built from configs (a BERT with the locally
trained WordPiece tokenizer of ``tinymodels``, a Llama decoder with the byte-level BPE one of ``tinylm``, left
padded as Qwen3-Embedding is), wrapped in module stacks (every pooling mode, with and without Dense, Normalize,
prompts, ``truncate_dim``), saved with ``SentenceTransformer.save`` and loaded back by path, as users' folders are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
PROMPTS = {"query": "query: ", "passage": "passage: ", "classify": "Classify the sentiment: "}


def build_bert_encoder(out: Path) -> Path:
    """A bare transformers encoder folder (BertModel, no sentence-transformers files)."""
    import torch
    from tinymodels import _tokenizer
    from transformers import BertConfig, BertModel

    tokenizer = _tokenizer()
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, initializer_range=0.5, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    BertModel(config).save_pretrained(out)
    tokenizer.model_max_length = 64
    tokenizer.save_pretrained(out)
    return out


def build_llama_encoder(out: Path) -> Path:
    """A bare decoder folder (LlamaModel) whose tokenizer pads on the left, as last-token embedders' do."""
    import torch
    from tinylm import build_tiny_lm
    from transformers import LlamaConfig, LlamaModel

    build_tiny_lm(out)  # the tokenizer (and a causal LM we replace with its bare model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.padding_side = "left"
    config = LlamaConfig.from_pretrained(out)
    config.architectures = ["LlamaModel"]
    torch.manual_seed(0)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    LlamaModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_stack(
    encoder: Path,
    out: Path,
    pooling: str = "mean",
    *,
    dense: int | None = None,
    normalize: bool = False,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
    include_prompt: bool = True,
    truncate_dim: int | None = None,
    max_seq_length: int | None = None,
) -> Path:
    """``encoder`` in Transformer -> Pooling(pooling) [-> Dense(dense, tanh)] [-> Normalize], saved to ``out``."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    torch.manual_seed(1)
    transformer = Transformer(str(encoder), max_seq_length=max_seq_length)
    width = transformer.get_embedding_dimension()
    modules: list[Any] = [transformer, Pooling(width, pooling_mode=pooling, include_prompt=include_prompt)]
    if dense:
        modules.append(Dense(width, dense, activation_function=torch.nn.Tanh()))
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(
        modules=modules, prompts=prompts, default_prompt_name=default_prompt_name, truncate_dim=truncate_dim
    )
    model.save(str(out))
    return out
