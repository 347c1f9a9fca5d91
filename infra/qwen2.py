"""rlake's own Qwen2 causal LM: the same modules, parameter names and eager math as
transformers' ``Qwen2ForCausalLM``, without transformers.

Why: importing transformers and its Qwen2 module (which pulls in ``torch._dynamo`` and
``torch.distributed.tensor``) costs ~3-4 s of CPU per process before the first iteration
(docs/operations.md, Startup). This module is ~0.1 s. It reads and writes the same HF folder
(``config.json`` + ``model.safetensors``), so checkpoints stay HF checkpoints, and on CPU in
fp32 its forward and gradients equal transformers' eager ones bit for bit (tested):

    h_0 = E[x]                                            (embedding; no gradient to pad_token_id)
    a   = h + W_o Attn(RoPE(W_q n(h) + b_q), RoPE(W_k n(h) + b_k), W_v n(h) + b_v)
    h'  = a + W_down (silu(W_gate n(a)) * W_up n(a))      (n: RMSNorm, one weight per use)
    Attn(q, k, v) = softmax(q k^T / sqrt(d) + M) v        (M: 0 where allowed, finfo.min else)
    logits = W_head n(h_L)                                (W_head = E when tied)

``infra.modeling.load_model`` uses it for the models ``supports`` accepts (plain Qwen2 with
full attention and default RoPE) on CPU; anything else, and CUDA (its fused SDPA path), stays
on transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from infra.model_checks import attention_problem, rope_problem, rope_theta

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


class ModelConfig(SimpleNamespace):
    """An HF ``config.json`` as attributes (``head_dim`` and ``rope_theta`` filled in); ``to_dict``
    gives back what was read, with any attribute changed since."""

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        config = cls(**raw)
        config.head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        config.rope_theta = rope_theta(config)
        config.layer_types = raw.get("layer_types") or ["full_attention"] * raw["num_hidden_layers"]
        config._raw_keys = list(raw)
        return config

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._raw_keys}


def supports(raw: dict[str, Any]) -> bool:
    """A plain Qwen2: full attention in every layer, plain RoPE over the whole head
    (``infra.model_checks``, the fast decoder's and the Megatron mapping's checks), SiLU; a raw
    ``config.json`` naming ``use_sliding_window`` is refused whatever its window (transformers
    derives the sliding layers from it)."""
    config = SimpleNamespace(**raw)
    return (raw.get("model_type") == "qwen2" and raw.get("hidden_act", "silu") == "silu"
            and not raw.get("use_sliding_window", False)
            and rope_problem(config) is None and attention_problem(config) is None)


def read_config(path: str | Path) -> dict[str, Any] | None:
    """The folder's ``config.json`` as a dict, or None when there is none."""
    file = Path(path) / CONFIG_FILE
    return json.loads(file.read_text()) if file.is_file() else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), in fp32 and cast back (as HF's Qwen2RMSNorm)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, base: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of pos * base^(-2i/d) in fp32, duplicated over both halves (HF's rotate_half
    layout). Also the fast decoder's tables (rollout/fast_decoder.py)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                            device=positions.device) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x*cos + rotate_half(x)*sin with rotate_half(x) = [-x2, x1] (HF's order of operations)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope(position_ids: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, S, d] for the attention's [B, heads, S, d] layout, in ``dtype``."""
    cos, sin = rope_tables(position_ids, head_dim, base)
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def additive_mask(attention_mask: torch.Tensor | None, batch: int, q_len: int, past: int,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """M [B, 1, Q, past+Q]: 0 where key j <= past + query i and key j is not padding, the
    dtype's most negative value elsewhere (a row with no allowed key stays finite)."""
    keys = torch.arange(past + q_len, device=device)
    allowed = (keys[None, :] <= (torch.arange(q_len, device=device) + past)[:, None])[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, :].bool()
    allowed = allowed.expand(batch, 1, q_len, past + q_len)
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=device),
                       torch.finfo(dtype).min)


class KVCache:
    """Keys and values of the positions seen so far, per layer (concatenated on update)."""

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def get_seq_length(self) -> int:
        return self.layers[0][0].shape[-2] if self.layers else 0

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer == len(self.layers):
            self.layers.append((k, v))
        else:
            old_k, old_v = self.layers[layer]
            self.layers[layer] = (torch.cat([old_k, k], dim=-2), torch.cat([old_v, v], dim=-2))
        return self.layers[layer]

    def reorder_cache(self, rows: torch.Tensor) -> None:
        """Row i becomes old row ``rows[i]`` (differentiable: ``index_select``)."""
        self.layers = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.layers]


@dataclass
class BaseOutput:
    last_hidden_state: torch.Tensor
    past_key_values: KVCache | None = None


@dataclass
class CausalLMOutput:
    logits: torch.Tensor
    past_key_values: KVCache | None = None


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        d, heads, kv_heads = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.layer_idx, self.head_dim, self.groups = layer_idx, d, heads // kv_heads
        self.dropout = getattr(config, "attention_dropout", 0.0)
        self.q_proj = nn.Linear(config.hidden_size, heads * d, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * d, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * d, bias=True)
        self.o_proj = nn.Linear(heads * d, config.hidden_size, bias=False)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None) -> torch.Tensor:
        shape = (*h.shape[:-1], -1, self.head_dim)
        q = self.q_proj(h).view(shape).transpose(1, 2)
        k = self.k_proj(h).view(shape).transpose(1, 2)
        v = self.v_proj(h).view(shape).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.head_dim ** -0.5 + mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = F.dropout(probs, p=self.dropout, training=self.training)
        out = torch.matmul(probs, v).transpose(1, 2).contiguous()
        return self.o_proj(out.reshape(*h.shape[:-1], -1).contiguous())


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, kvh, S, d] -> [B, kvh * groups, S, d], each KV head repeated for its query heads."""
    if groups == 1:
        return x
    b, kvh, s, d = x.shape
    return x[:, :, None].expand(b, kvh, groups, s, d).reshape(b, kvh * groups, s, d)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2Model(nn.Module):
    """The decoder (HF's ``Qwen2Model``): embedding, layers, final norm -> hidden states."""

    is_gradient_checkpointing = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # nn.Embedding's own init (normal_) imports torch._dynamo (~2.5 s) on the meta device
        # ``from_pretrained`` builds on: start it from HF's init instead (same distribution)
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if weight.device.type != "meta":
            nn.init.normal_(weight, std=getattr(config, "initializer_range", 0.02))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         getattr(config, "pad_token_id", None), _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def base_model(self) -> Qwen2Model:
        """Itself, as HF's base models answer (callers take ``model.base_model`` of either)."""
        return self

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None
                                      ) -> None:
        """Recompute every decoder layer in the backward (non-reentrant, the only kind here;
        not with a KV cache)."""
        self.is_gradient_checkpointing = True

    def new_cache(self) -> KVCache:
        return KVCache()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: KVCache | None = None,
                use_cache: bool | None = None) -> BaseOutput:
        """Hidden states [B, S, H] of ``input_ids`` [B, S] after the ``past_key_values``
        positions; ``attention_mask`` [B, past+S] (1 = real token); ``position_ids`` default to
        past .. past+S-1 (HF's default)."""
        h = self.embed_tokens(input_ids)
        cache = past_key_values
        if use_cache and cache is None:
            cache = KVCache()
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = (torch.arange(h.shape[1], device=h.device) + past)[None]
        cos, sin = rope(position_ids, self.config.head_dim, self.config.rope_theta, h.dtype)
        mask = additive_mask(attention_mask, h.shape[0], h.shape[1], past, h.dtype, h.device)
        checkpointed = self.is_gradient_checkpointing and self.training and cache is None
        for layer in self.layers:
            if checkpointed:
                h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, mask, use_reentrant=False)
            else:
                h = layer(h, cos, sin, mask, cache)
        return BaseOutput(self.norm(h), cache if use_cache else None)


class Qwen2ForCausalLM(nn.Module):
    """Decoder + output head (tied to the embedding when the config says so)."""

    def __init__(self, config: ModelConfig, generation_config: dict | None = None) -> None:
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.model = Qwen2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def base_model(self) -> Qwen2Model:
        return self.model

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None
                                      ) -> None:
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: KVCache | None = None,
                use_cache: bool | None = None) -> CausalLMOutput:
        out = self.model(input_ids, attention_mask, position_ids, past_key_values, use_cache)
        return CausalLMOutput(self.lm_head(out.last_hidden_state), out.past_key_values)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        raw_config: dict[str, Any] | None = None) -> Qwen2ForCausalLM:
        """The model in ``path`` (an HF folder, ``config.json`` + ``model.safetensors``) with
        weights in ``dtype``, on CPU; built on the meta device so nothing is initialised twice.
        ``raw_config``: the folder's config.json when the caller read it already."""
        from safetensors.torch import load_file

        folder = Path(path)
        config = ModelConfig.from_dict(raw_config or read_config(folder))
        generation = folder / GENERATION_CONFIG_FILE
        gen = json.loads(generation.read_text()) if generation.is_file() else None
        with torch.device("meta"):
            model = cls(config, gen)
        weights = {k: v.to(dtype) for k, v in load_file(folder / WEIGHTS_FILE).items()}
        if getattr(config, "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        model.load_state_dict(weights, strict=True, assign=True)
        model.tie_weights()
        return model

    def save_pretrained(self, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None
                        ) -> None:
        """``config.json`` (+ ``generation_config.json`` when the model came with one) and
        ``model.safetensors`` (the tied head left out, as HF writes it) into ``path``."""
        from safetensors.torch import save_file

        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        weights = dict(self.state_dict() if state_dict is None else state_dict)
        if getattr(self.config, "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)
        save_file({k: v.detach().contiguous() for k, v in weights.items()},
                  str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
        # config.json's dtype is the written tensors' (fp32 weights under a bf16 base's
        # "dtype": "bfloat16" were loaded by transformers as bf16, not as trained)
        config = self.config.to_dict()
        dtypes = {v.dtype for v in weights.values() if v.is_floating_point()}
        if len(dtypes) == 1:
            name = str(dtypes.pop()).removeprefix("torch.")
            config.update(dict.fromkeys([k for k in ("dtype", "torch_dtype") if k in config]
                                        or ["dtype"], name))
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if self.generation_config is not None:
            (folder / GENERATION_CONFIG_FILE).write_text(
                json.dumps(self.generation_config, indent=2, sort_keys=True) + "\n")


