"""A lean decoder for Qwen2/Llama-family HF models, used by the torch engine for sampling.

HF's module stack spends most of a decode step on Python overhead at small sizes. This runs the
same math (RMSNorm, RoPE, grouped-query attention, SwiGLU) from the HF model's own weights with
fused QKV / gate-up matrices and a preallocated KV cache, so a step is a few dozen tensor ops.
Numerics match the HF forward to fp32 rounding (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infra.model_checks import attention_problem, rope_problem, rope_theta
from infra.qwen2 import apply_rope, rope_tables


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight (one fused op)."""
    return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """One query per row, grouped-query: softmax(q k^T / sqrt(d) + bias) v, with the query heads
    of one KV head batched together. q [B, h, 1, d], k/v [B, kvh, T, d], bias [B, 1, 1, T]
    (0 or -inf) -> [B, h, d]."""
    bsz, n_heads, _, dim = q.shape
    n_kv = k.shape[1]
    scores = torch.matmul(q.view(bsz, n_kv, n_heads // n_kv, dim), k.transpose(-1, -2))
    # softmax in fp32 (a no-op cast in fp32, and what keeps bf16 decoding close to HF's)
    probs = torch.softmax(scores.mul_(dim ** -0.5).add_(bias), dim=-1, dtype=torch.float32)
    return torch.matmul(probs.to(v.dtype), v).view(bsz, n_heads, dim)


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    post_norm: torch.Tensor
    gate_up_w: torch.Tensor
    down_w: torch.Tensor


SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


def unsupported(config) -> str | None:
    """Why the fast decoder would not compute HF's forward for ``config`` (None: it would).

    It runs exactly: full causal attention in every layer, default RoPE over the whole head,
    q/k/v biases only, bias-free SiLU-gated MLP, unquantised weights. Anything else the model
    would do differently (a sliding window, an o_proj or MLP bias, scaled RoPE) gives other
    log-probs than the trainer's, so such a model takes the generic HF path instead."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {config.model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if problem := rope_problem(config):
        return problem
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    for key in ("attention_bias", "mlp_bias"):  # o_proj (and q/k/v) / gate-up-down biases
        if getattr(config, key, False):
            return f"{key}: true (biases on q/k/v only)"
    return attention_problem(config) or (
        "quantized weights" if getattr(config, "quantization_config", None) else None)


def supports(config) -> bool:
    """Whether the fast decoder computes ``config``'s forward as HF does (``unsupported``)."""
    return unsupported(config) is None


class FastDecoder:
    """Prefill + one-token decode steps over a preallocated KV cache [L, B, kvh, T, d]."""

    def __init__(self, model: torch.nn.Module):
        cfg = model.config
        problem = unsupported(cfg)
        if problem is not None:
            raise ValueError(f"FastDecoder does not support this model: {problem}")
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.rope_base = rope_theta(cfg)
        self.n_layers = cfg.num_hidden_layers
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        self.embed = sd["model.embed_tokens.weight"]
        self.device, self.dtype = self.embed.device, self.embed.dtype
        self._cos = self._sin = torch.empty(0, self.head_dim, device=self.device)
        self.layers: list[_Layer] = []
        self.refresh(model)

    def refresh(self, model: torch.nn.Module) -> None:
        """Take ``model``'s current weights: views of its tensors, and the fused QKV / gate-up
        matrices re-filled in place (no new allocation after the first call)."""
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        self.embed = sd["model.embed_tokens.weight"]
        self.final_norm = sd["model.norm.weight"]
        self.lm_head = sd.get("lm_head.weight", self.embed)
        old = self.layers
        self.layers = []
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            biases = [sd.get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            prev = old[i] if old else None
            self.layers.append(_Layer(
                input_norm=sd[p + "input_layernorm.weight"],
                qkv_w=_cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"],
                           prev.qkv_w if prev else None),
                qkv_b=_cat(biases, prev.qkv_b if prev else None) if biases[0] is not None else None,
                o_w=sd[p + "self_attn.o_proj.weight"],
                post_norm=sd[p + "post_attention_layernorm.weight"],
                gate_up_w=_cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]],
                               prev.gate_up_w if prev else None),
                down_w=sd[p + "mlp.down_proj.weight"]))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, S, 1, d] for ``positions`` from a table grown on demand."""
        self.ensure_rope(int(positions.max()) + 1)
        return self._cos[positions][:, :, None], self._sin[positions][:, :, None]

    def ensure_rope(self, needed: int) -> None:
        """Grow the cos/sin tables to at least ``needed`` positions (before a CUDA graph capture,
        which must not reallocate them)."""
        if self._cos.shape[0] < needed:
            table = torch.arange(max(needed, 2 * self._cos.shape[0], 64), device=self.device)
            cos, sin = rope_tables(table, self.head_dim, self.rope_base)
            # tables computed in fp32, stored in the weights' dtype as HF applies them
            self._cos, self._sin = cos.to(self.dtype), sin.to(self.dtype)

    def new_cache(self, batch: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The preallocated KV cache [L, B, kvh, max_len, d] in the weights' dtype/device."""
        shape = (len(self.layers), batch, self.n_kv, max_len, self.head_dim)
        return (torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device))

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor], start: int) -> torch.Tensor:
        """Logits of the last position for ``ids`` [B, S] written at cache slots start..start+S.

        ``key_valid`` [B, start+S] marks real (non-padding) cache slots.
        """
        k_cache, v_cache = cache
        bsz, seq = ids.shape
        end = start + seq
        h = self.embed[ids]
        cos, sin = self._rope(positions)
        allowed = key_valid[:, None, None, :end]
        dev = ids.device
        if seq > 1:
            causal = torch.ones(seq, end, dtype=torch.bool, device=dev).tril(diagonal=start)
            # a padding query sees itself, so its (unused) row stays finite instead of NaN
            itself = torch.zeros(seq, end, dtype=torch.bool, device=dev)
            itself[:, start:end] = torch.eye(seq, dtype=torch.bool, device=dev)
            allowed = (allowed & causal) | itself
        else:  # decode: one additive bias for every layer (measured faster than SDPA here)
            bias = torch.zeros(allowed.shape, dtype=self.dtype, device=dev).masked_fill_(
                ~allowed, float("-inf"))
        for li, layer in enumerate(self.layers):
            def attend(q, k, v, li=li):
                k_cache[li, :, :, start:end] = k
                v_cache[li, :, :, start:end] = v
                if seq > 1:
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, k_cache[li, :, :, :end], v_cache[li, :, :, :end], attn_mask=allowed,
                        enable_gqa=True).transpose(1, 2)
                return decode_attention(q, k_cache[li, :, :, :end], v_cache[li, :, :, :end], bias)
            h = self._layer(layer, h, cos, sin, attend)
        last = rms_norm(h[:, -1], self.final_norm, self.eps)
        return torch.nn.functional.linear(last, self.lm_head)

    def _layer(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attend) -> torch.Tensor:
        """One decoder layer on h [B, S, hidden]; ``attend(q, k, v)`` (q [B, h, S, d], k/v
        [B, kvh, S, d]) writes the cache and returns the attention output [B, S, h, d]."""
        bsz, seq = h.shape[:2]
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        x = rms_norm(h, layer.input_norm, self.eps)
        qkv = torch.nn.functional.linear(x, layer.qkv_w, layer.qkv_b)
        qk = apply_rope(qkv[..., :q_size + kv_size].view(bsz, seq, -1, self.head_dim), cos, sin)
        q, k = qk.transpose(1, 2).split([self.n_heads, self.n_kv], dim=1)
        v = qkv[..., q_size + kv_size:].view(bsz, seq, self.n_kv, self.head_dim).transpose(1, 2)
        attn = attend(q, k, v).reshape(bsz, seq, q_size)
        h = h + torch.nn.functional.linear(attn, layer.o_w)
        x = rms_norm(h, layer.post_norm, self.eps)
        gate, up = torch.nn.functional.linear(x, layer.gate_up_w).chunk(2, dim=-1)
        return h + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, layer.down_w)

    @torch.no_grad()
    def decode_static(self, ids: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
                      cache: tuple[torch.Tensor, torch.Tensor], start: torch.Tensor) -> torch.Tensor:
        """One decode step with every shape fixed and no host synchronisation, so it can be
        captured in a CUDA graph: ids/positions [B, 1], ``start`` a 1-element long tensor (the
        cache slot written), attention over all T cache slots with slot j allowed iff
        key_valid[:, j] and j <= start. The rope tables must already cover the positions
        (``ensure_rope``). Returns the logits [B, vocab]."""
        k_cache, v_cache = cache
        h = self.embed[ids]
        cos, sin = self._cos[positions][:, :, None], self._sin[positions][:, :, None]
        slots = torch.arange(k_cache.shape[3], device=ids.device)
        allowed = (key_valid & (slots <= start))[:, None, None, :]
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=ids.device).masked_fill_(
            ~allowed, float("-inf"))
        for li, layer in enumerate(self.layers):
            def attend(q, k, v, li=li):
                k_cache[li].index_copy_(2, start, k)
                v_cache[li].index_copy_(2, start, v)
                return decode_attention(q, k_cache[li], v_cache[li], bias)
            h = self._layer(layer, h, cos, sin, attend)
        return torch.nn.functional.linear(rms_norm(h[:, -1], self.final_norm, self.eps),
                                          self.lm_head)


def _cat(parts: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
    """torch.cat(parts), written into ``out`` when it has the right shape/dtype/device."""
    rows = sum(p.shape[0] for p in parts)
    if out is not None and out.shape[0] == rows and out.dtype == parts[0].dtype \
            and out.device == parts[0].device:
        return torch.cat(parts, out=out)
    return torch.cat(parts)
