"""Tiny models of each batch task, built from configs with a locally trained WordPiece tokenizer and saved
like hub models, so that tests load them through the normal ``from_pretrained(path)`` code (nothing is
downloaded): a sentiment-style classifier, a cross-encoder reranker (one output) and a ViT image
classifier with its image processor."""

from __future__ import annotations

import io
from pathlib import Path

CORPUS = [
    "the movie was wonderful and the actors were great",
    "a terrible film, boring and far too long",
    "what is the capital of france? paris is the capital of france.",
    "berlin is the capital of germany and its largest city",
    "zserve batches many small requests into well filled batches",
    "the quick brown fox jumps over the lazy dog",
    "rerank the documents by how well they answer the query",
] * 20

CLASSIFIER_LABELS = {0: "negative", 1: "neutral", 2: "positive"}
IMAGE_LABELS = {0: "cat", 1: "dog", 2: "bird", 3: "fish"}


def _tokenizer():  # a transformers BertTokenizerFast
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return BertTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]",
    )  # fmt: skip


def _bert(out: Path, num_labels: int, id2label: dict[int, str] | None) -> Path:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    tokenizer = _tokenizer()
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        num_labels=num_labels,
        initializer_range=0.5,
        pad_token_id=tokenizer.pad_token_id,
        **({"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}} if id2label else {}),
    )  # fmt: skip  (a wide initialisation: scores that differ clearly between inputs)
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_classifier(out: Path) -> Path:
    return _bert(out, len(CLASSIFIER_LABELS), CLASSIFIER_LABELS)


def build_tiny_cross_encoder(out: Path) -> Path:
    return _bert(out, 1, None)


def build_tiny_vit(out: Path) -> Path:
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    config = ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        num_labels=len(IMAGE_LABELS), initializer_range=0.5, id2label=IMAGE_LABELS,
        label2id={v: k for k, v in IMAGE_LABELS.items()},
    )  # fmt: skip
    torch.manual_seed(0)
    ViTForImageClassification(config).save_pretrained(out)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(out)
    return out


def image_file(width: int, height: int, fmt: str = "PNG", seed: int = 0) -> bytes:
    """An image file of random pixels."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()
