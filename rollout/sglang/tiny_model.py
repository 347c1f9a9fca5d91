"""A tiny random Qwen2 checkpoint + character tokenizer that SGLang can serve (tests, bench).

Built with transformers in a folder, nothing downloaded. The project's own model/tokenizer
builders live in ``infra``; this one is self-contained so the SGLang tests depend on nothing else.
"""

from __future__ import annotations

from pathlib import Path

CHARS = "0123456789+=? "
SPECIALS = ("<pad>", "<eos>")


def build_tokenizer(out_dir: str | Path):
    """A character-level WordLevel tokenizer (vocab = SPECIALS + CHARS = 16 ids), saved to out_dir."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIALS, *CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="?"
    )
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_qwen2(
    out_dir: str | Path,
    seed: int = 0,
    num_layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
) -> Path:
    """Save a randomly initialised fp32 Qwen2 (vocab 16) and its tokenizer to ``out_dir``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    cfg = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    return out
