"""Model and tokenizer loading (HF format), and the tiny model the quickstart builds offline."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from infra import qwen2
from infra import tokenizer as tokenizer_cache
from infra.config import ConfigError, TinyModelConfig
from infra.db_template import cache_dir, copy_in, write_once
from infra.tokenizer import PlainTokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# transformers is imported where it is used (building the tiny model, tokenizers, models
# infra.qwen2 does not cover): its import and model modules are seconds of start-up CPU.

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
# Enough characters for the built-in tasks (arithmetic, countdown, a calculator tool).
CHARSET = list("0123456789+-*/=()., :<>[]") + list("abcdefghijklmnopqrstuvwxyz")


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer in HF format: one token per character.

    It is written as a byte-level BPE without merges (GPT-2's byte alphabet: a space is the token
    ``Ġ``), the form Qwen2's tokenizer rebuilds any Qwen2 folder's tokenizer into: transformers'
    AutoTokenizer loads a Qwen2 folder as ``Qwen2Tokenizer`` whatever its tokenizer_config.json
    says, and a plain character vocabulary lost its spaces there ("a b" became "ab"). Characters
    outside CHARSET other than spaces keep their ids (printable ASCII is its own byte-level
    character)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = {" ": "\u0120"}  # Ġ
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + [byte_level.get(c, c) for c in CHARSET])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>", padding_side="left", clean_up_tokenization_spaces=False)


def build_tiny_model(out_dir: str | Path, tiny: TinyModelConfig, seed: int = 0) -> Path:
    """Create a random-init tiny Qwen2 + char tokenizer and save both in HF format."""
    from transformers import AutoModelForCausalLM, Qwen2Config

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


# what a tiny model folder holds once complete (a folder missing one is built again)
TINY_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def tiny_model_key(tiny: TinyModelConfig, seed: int) -> str:
    """What a tiny model's bits depend on: its config, the seed, the torch and transformers
    versions (their init code) and the CPU's vector instruction set (torch's CPU sampling
    kernels differ between them), hashed."""
    try:
        transformers_version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers_version = ""
    parts = [tiny.model_dump_json(), str(seed), torch.__version__, transformers_version,
             torch.backends.cpu.get_cpu_capability()]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in TINY_MODEL_FILES)


def tiny_model(out_dir: str | Path, tiny: TinyModelConfig, seed: int = 0) -> Path:
    """``build_tiny_model``'s folder at ``out_dir``, built once per machine and configuration:

        {cache}/tiny-models/<tiny_model_key(tiny, seed)>/

    A complete folder already at ``out_dir`` (a resumed run's) is used as it is; else the cached
    one is copied there, building it first when missing (``db_template.write_once``: one builder,
    a folder renamed into place whole). Building imports transformers (seconds of start-up, ~5 s
    here); a copy does not, and holds the same bytes."""
    out = Path(out_dir)
    if _complete(out):
        return out
    cached = cache_dir() / "tiny-models" / tiny_model_key(tiny, seed)
    try:
        write_once(cached, lambda tmp: build_tiny_model(tmp, tiny, seed), wait=True)
    except OSError:  # a read-only cache: build in place, as before the cache
        return build_tiny_model(out, tiny, seed)
    shutil.rmtree(out, ignore_errors=True)  # an incomplete one left by a crash
    copy_in(cached, out)
    return out


def use_deterministic_algorithms() -> None:
    """``torch.use_deterministic_algorithms(True)`` without what that call imports first:
    ``torch._inductor.config`` (with torch._dynamo and sympy: ~2.6 s of start-up here), only to
    set the flag torch.compile reads, and rlake compiles nothing. Once inductor is loaded the
    call is torch's own, so that flag is set too."""
    if "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(True)
    else:
        torch._C._set_deterministic_algorithms(True)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_device(device: str, cuda_available: bool | None = None) -> str:
    """The config's ``device`` (auto | cpu | cuda) as "cpu" or "cuda": auto = cuda when a CUDA
    device is present. cuda without one is a ConfigError naming the key."""
    has_cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if device == "auto":
        return "cuda" if has_cuda else "cpu"
    if device == "cuda" and not has_cuda:
        raise ConfigError("bad config value for 'device': cuda was requested but torch sees no "
                          "CUDA device (use device: cpu or auto)")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"bad config value for 'device': {device!r} (allowed: auto, cpu, cuda)")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """The config's ``dtype`` (auto | fp32 | bf16) as "fp32" or "bf16": auto = bf16 on cuda,
    fp32 on cpu (determinism and the CPU tests)."""
    if dtype == "auto":
        return "bf16" if device == "cuda" else "fp32"
    if dtype not in DTYPES:
        raise ConfigError(f"bad config value for 'dtype': {dtype!r} (allowed: auto, fp32, bf16)")
    return dtype


def placement(device: str, dtype: str) -> tuple[str, str]:
    """(device, dtype) resolved from the config's ``device`` and ``dtype``."""
    resolved = resolve_device(device)
    return resolved, resolve_dtype(dtype, resolved)


def attention_for(device: str) -> str:
    """eager on CPU (deterministic, identical in trainer and engine), sdpa on CUDA (fused)."""
    return "sdpa" if device == "cuda" else "eager"


def own_model_config(path: str | Path, device: str) -> dict | None:
    """The folder's config.json when infra.qwen2 serves it: a plain Qwen2 folder (one
    ``model.safetensors``) on CPU; None otherwise (CUDA keeps transformers' fused SDPA
    attention, other architectures transformers' own modules)."""
    if device != "cpu" or not (Path(path) / qwen2.WEIGHTS_FILE).is_file():
        return None
    raw = qwen2.read_config(path)
    return raw if raw is not None and qwen2.supports(raw) else None


def load_model(path: str | Path, device: str = "cpu", dtype: str = "fp32") -> torch.nn.Module:
    """An HF causal LM with weights in ``dtype`` on ``device`` (resolved names: cpu|cuda,
    fp32|bf16). The CPU default, fp32 + eager attention, keeps trainer and engine identical so
    rollout and training log-probs agree; a plain Qwen2 on CPU is infra.qwen2's (the same math
    and names, bit for bit, without importing transformers)."""
    raw = own_model_config(path, device)
    if raw is not None:
        raw = {k: 0.0 if _is_dropout(k, v) else v for k, v in raw.items()}  # without_dropout's why
        return qwen2.Qwen2ForCausalLM.from_pretrained(path, DTYPES[dtype], raw)
    return load_transformers_model(path, device, dtype)


def load_transformers_model(path: str | Path, device: str = "cpu", dtype: str = "fp32"
                            ) -> torch.nn.Module:
    """transformers' own model class for the folder (``generate``, ``labels``: the benches'
    yardsticks), eager attention on CPU and SDPA on CUDA."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = without_dropout(AutoConfig.from_pretrained(str(path)))
    check_causal_lm(config, path)
    model = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=DTYPES[dtype],
                                                 attn_implementation=attention_for(device))
    return model.to(device)


SUPPORTED_MODELS = ("decoder-only causal LMs that transformers' AutoModelForCausalLM loads "
                    "(Qwen2, Llama, Mistral, Gemma, GPT-2, ...)")


def check_causal_lm(config, path: str | Path) -> None:
    """Refuse a model that is not a decoder-only causal LM, in one line naming model.path.

    rlake samples left to right and trains log pi(y_t | x, y_<t): an encoder-decoder (T5) has
    no such single stack (transformers refused it with a 200-class list), and a BERT-style model
    with ``is_decoder: false`` attends both ways, so AutoModelForCausalLM loaded it and it was
    trained as if it were causal. Configs without an ``is_decoder`` attribute are decoders."""
    kind = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        why = f"an encoder-decoder model ({kind})"
    elif getattr(config, "is_decoder", True) is False:
        why = f"not a causal decoder ({kind} with is_decoder: false attends both ways)"
    else:
        return
    raise ConfigError(f"model.path '{path}': {why}; supported: {SUPPORTED_MODELS}")


def without_dropout(config):
    """``config`` (an HF config) with every dropout probability set to 0, as slime and verl
    load a policy: the trainer runs its forwards in train mode, so a model whose config has
    dropout (``attention_dropout: 0.3``) gave the old-log-prob pass, the grad pass and the
    engine (eval mode) three different policies, and the PPO ratio was noise around 1 before
    any update (review, 2026-11-29). ``load_model`` does the same to the config.json dict it
    gives infra.qwen2's model (its attention reads ``attention_dropout``)."""
    for key, value in config.to_dict().items():
        if _is_dropout(key, value):
            setattr(config, key, 0.0)
    return config


def _is_dropout(key: str, value: object) -> bool:
    return ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) and value > 0


def base_model_from_config(config, device: str = "cpu") -> torch.nn.Module:
    """An untrained fp32 decoder (no output head) of ``config``'s shape on ``device``: a
    critic's backbone, loaded afterwards. ``config`` is a policy's: infra.qwen2's or HF's."""
    config = without_dropout(copy.deepcopy(config))
    if isinstance(config, qwen2.ModelConfig):
        return qwen2.Qwen2Model(config).to(device)
    from transformers import AutoModel

    return AutoModel.from_config(config, attn_implementation=attention_for(device),
                                 dtype=torch.float32).to(device)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast | PlainTokenizer:
    """The folder's tokenizer as transformers' AutoTokenizer builds it (the class comes from
    config.json: a Qwen2 folder gets Qwen2Tokenizer's pre-tokenizer and byte-level decoder),
    from rlake's cache without importing transformers when it was built before (infra.tokenizer).
    Its special tokens are checked against the model's vocabulary (``special_tokens_in_vocab``)."""
    missing = tokenizer_cache.missing_tokenizer(path)
    if missing:
        raise ConfigError(missing)
    tokenizer = tokenizer_cache.load_tokenizer(path)
    special_tokens_in_vocab(tokenizer, path)
    return tokenizer


def special_tokens_in_vocab(tokenizer, path: str | Path) -> None:
    """The eos token must be one of the model's tokens (``vocab_size`` in config.json); a pad
    token that is missing or outside the vocabulary becomes the eos token, as TRL does (a
    tokenizer without one padded with an id the model does not have: an index error after
    the first evaluation)."""
    config = Path(path) / "config.json"
    vocab = json.loads(config.read_text()).get("vocab_size") if config.is_file() else None

    def known(token_id: int | None) -> bool:
        return token_id is not None and (vocab is None or 0 <= token_id < vocab)

    if not known(tokenizer.eos_token_id):
        raise ConfigError(f"model.path '{path}': its tokenizer's eos token (id "
                          f"{tokenizer.eos_token_id}) is not a token of the model (vocab_size {vocab})")
    if not known(tokenizer.pad_token_id):
        tokenizer.pad_token_id = tokenizer.eos_token_id
