"""Token log-probs and entropy from hidden states, over the vocabulary in chunks.

For N response positions with final hidden states h [N, H], the output matrix W [V, H] and
temperature T, the logits are z = h W^T / T. Computing them whole is a [N, V] fp32 tensor (20 GB
for 64 x 512 tokens of a 152k vocabulary), and autograd would keep it for the backward pass.
``chunked_logprobs`` never holds more than [N, chunk]: the forward keeps an online
log-sum-exp, the backward recomputes each chunk's logits (as activation checkpointing does).

    lse   = log sum_v exp(z_v)
    logp  = z_y - lse                            (y: the target token)
    H     = lse - mu,   mu = sum_v p_v z_v,  p = softmax(z)
    dlogp/dz_v = 1[v = y] - p_v
    dH/dz_v    = -p_v (z_v - mu)
"""

from __future__ import annotations

import torch
from torch import Tensor


def _acc_dtype(h: Tensor) -> torch.dtype:
    """fp32 accumulation (fp64 for fp64 inputs): bf16 sums over 152k ids would be too coarse."""
    return torch.promote_types(h.dtype, torch.float32)


def _chunk_logits(h: Tensor, w: Tensor, start: int, end: int, temperature: float) -> Tensor:
    """z[:, start:end] = h W[start:end]^T / T in the accumulation dtype (the matmul itself in
    h's dtype, or autocast's)."""
    return (h @ w[start:end].t()).to(_acc_dtype(h)) / temperature


class _ChunkedLogprobs(torch.autograd.Function):
    """(logp [N], entropy [N]) of targets [N] under softmax(h W^T / T), chunked over V."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, h: Tensor, w: Tensor, targets: Tensor, temperature: float,
                chunk: int) -> tuple[Tensor, Tensor]:
        n, vocab = h.shape[0], w.shape[0]
        acc = _acc_dtype(h)
        m = torch.full((n,), float("-inf"), device=h.device, dtype=acc)
        s = torch.zeros(n, device=h.device, dtype=acc)
        sz = torch.zeros(n, device=h.device, dtype=acc)
        zy = torch.zeros(n, device=h.device, dtype=acc)
        rows = torch.arange(n, device=h.device)
        for start in range(0, vocab, chunk):
            end = min(start + chunk, vocab)
            z = _chunk_logits(h, w, start, end, temperature)
            new_m = torch.maximum(m, z.max(dim=-1).values)
            scale = torch.exp(m - new_m)
            e = torch.exp(z - new_m[:, None])
            s = s * scale + e.sum(dim=-1)
            sz = sz * scale + (e * z).sum(dim=-1)
            m = new_m
            inside = (targets >= start) & (targets < end)
            local = (targets - start).clamp(0, end - start - 1)
            zy = torch.where(inside, z[rows, local], zy)
        lse = m + torch.log(s)
        mu = sz / s
        ctx.save_for_backward(h, w, targets, lse, mu)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)
        return zy - lse, lse - mu

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, g_logp: Tensor | None, g_entropy: Tensor | None):
        h, w, targets, lse, mu = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = _acc_dtype(h)
        grad_h = torch.zeros(h.shape, dtype=acc, device=h.device) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=acc, device=w.device) if need_w else None
        if (g_logp is None and g_entropy is None) or not (need_h or need_w):
            return None, None, None, None, None
        rows = torch.arange(h.shape[0], device=h.device)
        for start in range(0, w.shape[0], chunk):
            end = min(start + chunk, w.shape[0])
            z = _chunk_logits(h, w, start, end, temperature)
            p = torch.exp(z - lse[:, None])
            g_z = torch.zeros_like(z)
            if g_logp is not None:
                g_z -= g_logp[:, None] * p
                inside = (targets >= start) & (targets < end)
                g_z[rows[inside], targets[inside] - start] += g_logp[inside]
            if g_entropy is not None:
                g_z -= g_entropy[:, None] * p * (z - mu[:, None])
            g_z = (g_z / temperature).to(h.dtype)
            if need_h:
                grad_h += (g_z @ w[start:end]).to(acc)
            if need_w:
                grad_w[start:end] += (g_z.t() @ h).to(acc)
        return (None if grad_h is None else grad_h.to(h.dtype),
                None if grad_w is None else grad_w.to(w.dtype), None, None, None)


def chunked_logprobs(h: Tensor, w: Tensor, targets: Tensor, temperature: float = 1.0,
                     chunk: int = 16384) -> tuple[Tensor, Tensor]:
    """(log softmax(h W^T / T)[y], entropy of softmax(h W^T / T)) for h [..., H], W [V, H],
    targets [...]; both [...] in fp32 (fp64 for fp64 inputs). Differentiable in h and W; at most [N, chunk] logits
    exist at a time. Detach the entropy when it needs no gradient (its backward is skipped)."""
    lead = targets.shape
    flat_h = h.reshape(-1, h.shape[-1])
    logp, entropy = _ChunkedLogprobs.apply(flat_h, w, targets.reshape(-1), float(temperature),
                                           int(chunk))
    return logp.view(lead), entropy.view(lead)


# Architectures whose logits are exactly lm_head(base_model(...).last_hidden_state), read in
# their transformers modeling code: an allow-list, since a new architecture may transform the
# logits (Gemma2/3 soft-capping, Granite's logits_scaling, Cohere's logit_scale) and the
# shortcut would then train another policy than the one the engine samples from.
PLAIN_HEAD_MODEL_TYPES = frozenset({
    "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "llama", "mistral", "mixtral", "gemma", "olmo2",
    "phi3", "gpt2", "gpt_neox"})
# Config keys of an output-logit transform: any of them set means no shortcut, even on an
# allow-listed architecture (a fork that reuses its model_type).
LOGIT_TRANSFORM_KEYS = ("final_logit_softcapping", "logits_scaling", "logit_scale",
                        "lm_head_multiplier", "output_multiplier_scale", "logits_soft_cap")


def plain_head_config(config) -> bool:
    """Whether a model of ``config`` computes its logits as head(final hidden state), untransformed."""
    if getattr(config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return False
    return all(getattr(config, key, None) in (None, 1, 1.0) for key in LOGIT_TRANSFORM_KEYS)


def linear_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The causal LM's output projection when it is a plain bias-free Linear whose output is the
    model's logits as they are (Qwen2, Llama: ``plain_head_config``), else None (callers fall
    back to the model's full logits, which apply any soft-capping or scaling)."""
    config = getattr(model, "config", None)
    if config is None or not plain_head_config(config):
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Linear) and head.bias is None and hasattr(model, "base_model") \
            and model.base_model is not model:
        return head
    return None
