"""What rlake's own model code computes, checked on a model's config: plain RoPE over the whole
head, full causal attention in every layer. A config object (transformers') or a namespace over
a raw ``config.json`` (``infra.qwen2.supports``); no imports beyond the standard library, so
every model loader can use it."""

from __future__ import annotations


def rope_params(config) -> dict:
    """RoPE settings: transformers 5's ``rope_parameters``, else the older ``rope_scaling``."""
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def rope_theta(config) -> float:
    """RoPE's base: ``rope_parameters["rope_theta"]`` (transformers 5), else the config's own
    ``rope_theta``, else 10000."""
    return float(rope_params(config).get("rope_theta") or getattr(config, "rope_theta", None)
                 or 10000.0)


def rope_problem(config) -> str | None:
    """RoPE other than the default over the whole head (a scaled or partial one), named as the
    config names it; None for plain RoPE. rlake's fast decoder, its Qwen2 module and the Megatron
    mapping compute plain RoPE only."""
    rope = rope_params(config)
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"RoPE type {rope.get('rope_type', rope.get('type'))!r} (only default RoPE)"
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        return f"partial_rotary_factor {partial} (RoPE over the whole head only)"
    return None


def attention_problem(config) -> str | None:
    """A layer that does not attend over the whole causal prefix (sliding window), named as the
    config names it; None if every layer attends over the whole causal prefix. rlake's fast
    decoder, its Qwen2 module and the Megatron mapping compute full attention only."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        other = sorted({t for t in layer_types if t != "full_attention"})
        return f"layer_types {other} (full_attention only)" if other else None
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", False) and window is not None:
        return f"use_sliding_window with sliding_window {window} (full attention only)"
    return None
