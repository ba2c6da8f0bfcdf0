"""A tiny causal LM with a locally trained byte-level BPE tokenizer, saved like a hub model so that tests
load it through the normal ``from_pretrained(path)`` code (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "DeepSpeed is a deep learning optimization library.",
    "Seattle is a city in the state of Washington.",
    "zserve batches many small requests into well filled batches.",
    "Emoji travel as several bytes: 🚀 🌍 🎉 and so do CJK characters: 你好 世界。日本語のテキスト。",
    "The quick brown fox jumps over the lazy dog.",
] * 20


def byte_level_bpe(corpus: list[str], vocab_size: int, special_tokens: list[str]):
    """A byte-level BPE tokenizer (GPT-2/Llama 3/Qwen style) trained on ``corpus``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def build_tiny_lm(out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = byte_level_bpe(CORPUS, 400, ["<pad>", "<s>", "</s>"])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    hf_tok.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    config = LlamaConfig(
        vocab_size=len(hf_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    hf_tok.save_pretrained(out)
    return out
