"""HF Qwen2/Llama state dicts <-> megatron-core GPTModel (local layer spec) state dicts.

Name map for layer ``i`` (HF ``model.layers.i.`` <-> Megatron ``decoder.layers.i.``):

| HF | Megatron | TP split |
|---|---|---|
| ``model.embed_tokens.weight`` | ``embedding.word_embeddings.weight`` | vocab rows |
| ``input_layernorm.weight`` | ``input_layernorm.weight`` | replicated |
| ``self_attn.{q,k,v}_proj.{weight,bias}`` | ``self_attention.linear_qkv.{weight,bias}`` | query groups |
| ``self_attn.o_proj.weight`` | ``self_attention.linear_proj.weight`` | input columns |
| ``post_attention_layernorm.weight`` | ``pre_mlp_layernorm.weight`` | replicated |
| ``mlp.{gate,up}_proj.weight`` | ``mlp.linear_fc1.weight`` | gate and up rows |
| ``mlp.down_proj.weight`` | ``mlp.linear_fc2.weight`` | input columns |
| ``model.norm.weight`` | ``decoder.final_layernorm.weight`` | replicated |
| ``lm_head.weight`` (untied) | ``output_layer.weight`` | vocab rows |

Fused QKV is laid out per query group g = 0..G-1: ``[q heads of g (H/G * d rows); k_g (d); v_g
(d)]``, so a contiguous split over TP ranks hands each rank whole groups. Fused fc1 on TP rank r
of N is ``[gate rows chunk r; up rows chunk r]``. The vocabulary is padded with zero rows to a
multiple of N (``padded_vocab_size``); the trainer masks padded logits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class ModelShape:
    """The architecture facts the mapping needs, read from an HF Qwen2/Llama config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, cfg: object) -> ModelShape:
        """Read a transformers ``Qwen2Config``/``LlamaConfig``; refuse what the mapping lacks."""
        model_type = getattr(cfg, "model_type", "")
        if model_type not in ("qwen2", "llama"):
            raise ValueError(f"config.model_type={model_type!r}: only 'qwen2' and 'llama' map")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"config.hidden_act={cfg.hidden_act!r}: only 'silu' (SwiGLU) maps")
        if getattr(cfg, "mlp_bias", False):
            raise ValueError("config.mlp_bias=True: MLP biases are not mapped")
        # Llama's attention_bias is on o_proj too, which Megatron would add only with the MLP's
        if model_type == "llama" and getattr(cfg, "attention_bias", False):
            raise ValueError("config.attention_bias=True: Llama's o_proj bias is not mapped")
        from infra.model_checks import attention_problem, rope_problem, rope_theta

        # as the fast decoder's checks: the mapping's layers run plain RoPE and full attention
        if problem := rope_problem(cfg) or attention_problem(cfg):
            raise ValueError(f"config {problem}: the mapping runs plain RoPE and full attention only")
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        if heads % kv:
            raise ValueError(f"num_attention_heads={heads} not a multiple of "
                             f"num_key_value_heads={kv}")
        qkv_bias = model_type == "qwen2"
        return cls(
            num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_heads=heads,
            num_kv_heads=kv,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            ffn_hidden_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
            tie_word_embeddings=bool(cfg.tie_word_embeddings), qkv_bias=qkv_bias,
            rope_theta=rope_theta(cfg), rms_norm_eps=float(cfg.rms_norm_eps),
            max_position_embeddings=int(cfg.max_position_embeddings),
        )


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Smallest multiple of ``tp_size`` >= ``vocab_size``: ceil(V / N) * N."""
    return -(-vocab_size // tp_size) * tp_size


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, num_groups: int) -> Tensor:
    """Per-group fused QKV: cat over g of [q_g; k_g; v_g] along dim 0 (weights or biases)."""
    rest = q.shape[1:]
    qg = q.reshape(num_groups, -1, *rest)
    kg = k.reshape(num_groups, -1, *rest)
    vg = v.reshape(num_groups, -1, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def split_qkv(qkv: Tensor, num_groups: int, q_rows_per_group: int,
              kv_rows_per_group: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`fuse_qkv` for ``num_groups`` groups (the groups of one shard or all)."""
    rest = qkv.shape[1:]
    g = qkv.reshape(num_groups, q_rows_per_group + 2 * kv_rows_per_group, *rest)
    q, k, v = torch.split(g, [q_rows_per_group, kv_rows_per_group, kv_rows_per_group], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _rows(t: Tensor, rank: int, size: int) -> Tensor:
    """Column-parallel shard: rows chunk ``rank`` of ``size`` (dim 0)."""
    if t.shape[0] % size:
        raise ValueError(f"dim 0 of size {t.shape[0]} does not split over {size} TP ranks")
    return t.chunk(size, dim=0)[rank].clone()


def _cols(t: Tensor, rank: int, size: int) -> Tensor:
    """Row-parallel shard: columns chunk ``rank`` of ``size`` (dim 1)."""
    if t.shape[1] % size:
        raise ValueError(f"dim 1 of size {t.shape[1]} does not split over {size} TP ranks")
    return t.chunk(size, dim=1)[rank].clone()


def _pad_vocab(w: Tensor, padded: int) -> Tensor:
    if w.shape[0] == padded:
        return w
    return torch.cat([w, w.new_zeros(padded - w.shape[0], *w.shape[1:])], dim=0)


def layer_range(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """Global layer indices held by pipeline stage ``pp_rank``: an even contiguous split."""
    if num_layers % pp_size:
        raise ValueError(f"num_hidden_layers={num_layers} does not split over "
                         f"pipeline_model_parallel_size={pp_size}")
    per = num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def hf_to_megatron(hf: Mapping[str, Tensor], shape: ModelShape, tp_rank: int = 0,
                   tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> dict[str, Tensor]:
    """The Megatron GPTModel state dict of TP rank ``tp_rank``/PP stage ``pp_rank``.

    Layer keys are stage-local (``decoder.layers.{i - first}``), as megatron names them.
    """
    if shape.num_kv_heads % tp_size:
        raise ValueError(f"num_key_value_heads={shape.num_kv_heads} does not split over "
                         f"tensor_model_parallel_size={tp_size}")
    out: dict[str, Tensor] = {}
    vpad = padded_vocab_size(shape.vocab_size, tp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    embed = _pad_vocab(hf["model.embed_tokens.weight"], vpad)
    if first:
        out["embedding.word_embeddings.weight"] = _rows(embed, tp_rank, tp_size)
    groups = shape.num_kv_heads
    for local, i in enumerate(layer_range(shape.num_layers, pp_rank, pp_size)):
        h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"].clone()
        names = ("weight", "bias") if shape.qkv_bias else ("weight",)
        for kind in names:
            qkv = fuse_qkv(*(hf[f"{h}self_attn.{p}_proj.{kind}"] for p in "qkv"), groups)
            out[f"{m}self_attention.linear_qkv.{kind}"] = _rows(qkv, tp_rank, tp_size)
        out[m + "self_attention.linear_proj.weight"] = _cols(hf[h + "self_attn.o_proj.weight"],
                                                             tp_rank, tp_size)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([
            _rows(hf[h + "mlp.gate_proj.weight"], tp_rank, tp_size),
            _rows(hf[h + "mlp.up_proj.weight"], tp_rank, tp_size)], dim=0)
        out[m + "mlp.linear_fc2.weight"] = _cols(hf[h + "mlp.down_proj.weight"], tp_rank, tp_size)
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not shape.tie_word_embeddings:
            head = _pad_vocab(hf["lm_head.weight"], vpad)
            out["output_layer.weight"] = _rows(head, tp_rank, tp_size)
        elif pp_size > 1:  # megatron keeps a synced copy of the tied embedding on the last stage
            out["output_layer.weight"] = _rows(embed, tp_rank, tp_size)
    return out


def megatron_to_hf(shards: Sequence[Mapping[str, Tensor]], shape: ModelShape,
                   pp_rank: int = 0, pp_size: int = 1) -> dict[str, Tensor]:
    """Merge the TP shards (index = TP rank) of one PP stage back into HF names.

    Keys other than weights (``*._extra_state``) are ignored. With ``pp_size > 1`` each stage
    gives its part; the caller unions the stages' dicts.
    """
    tp = len(shards)
    groups_per_rank = shape.num_kv_heads // tp
    q_rows = shape.num_heads // shape.num_kv_heads * shape.head_dim
    kv_rows = shape.head_dim
    out: dict[str, Tensor] = {}
    first, last = pp_rank == 0, pp_rank == pp_size - 1

    def rows(key: str) -> Tensor:
        return torch.cat([s[key] for s in shards], dim=0)

    def cols(key: str) -> Tensor:
        return torch.cat([s[key] for s in shards], dim=1)

    if first:
        out["model.embed_tokens.weight"] = rows("embedding.word_embeddings.weight")[
            :shape.vocab_size].clone()
    for local, i in enumerate(layer_range(shape.num_layers, pp_rank, pp_size)):
        h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        out[h + "input_layernorm.weight"] = shards[0][m + "input_layernorm.weight"].clone()
        out[h + "post_attention_layernorm.weight"] = shards[0][m + "pre_mlp_layernorm.weight"
                                                               ].clone()
        names = ("weight", "bias") if shape.qkv_bias else ("weight",)
        for kind in names:
            parts = [split_qkv(s[f"{m}self_attention.linear_qkv.{kind}"], groups_per_rank,
                               q_rows, kv_rows) for s in shards]
            for j, p in enumerate("qkv"):
                out[f"{h}self_attn.{p}_proj.{kind}"] = torch.cat([x[j] for x in parts], dim=0)
        out[h + "self_attn.o_proj.weight"] = cols(m + "self_attention.linear_proj.weight")
        gates, ups = zip(*(s[m + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards),
                         strict=True)
        out[h + "mlp.gate_proj.weight"] = torch.cat(gates, dim=0)
        out[h + "mlp.up_proj.weight"] = torch.cat(ups, dim=0)
        out[h + "mlp.down_proj.weight"] = cols(m + "mlp.linear_fc2.weight")
    if last:
        out["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"].clone()
        if not shape.tie_word_embeddings:
            out["lm_head.weight"] = rows("output_layer.weight")[:shape.vocab_size].clone()
    return out
