"""Model and tokenizer loading (HF format), and the tiny model the quickstart builds offline."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

from infra.config import TinyModelConfig

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
# Enough characters for the built-in tasks (arithmetic, countdown, a calculator tool).
CHARSET = list("0123456789+-*/=()., :<>[]") + list("abcdefghijklmnopqrstuvwxyz")


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer in HF format: one token per character."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARSET)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>", padding_side="left", clean_up_tokenization_spaces=False)


def build_tiny_model(out_dir: str | Path, tiny: TinyModelConfig, seed: int = 0) -> Path:
    """Create a random-init tiny Qwen2 + char tokenizer and save both in HF format."""
    out = Path(out_dir)
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=tiny.hidden_size,
        num_hidden_layers=tiny.num_hidden_layers, num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads, intermediate_size=tiny.intermediate_size,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=tiny.tie_word_embeddings, rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, use_sliding_window=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def load_model(path: str | Path) -> torch.nn.Module:
    """An HF causal LM in fp32, eager attention (deterministic on CPU, identical in trainer and
    engine, so rollout and training log-probs agree)."""
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                attn_implementation="eager")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(str(path))
