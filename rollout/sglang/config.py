"""Settings of the SGLang engine (config section ``rollout.sglang``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class SGLangConfig:
    """How the SGLang engine runs.

    ``urls`` non-empty: connect to running servers (no launch, no restart). Otherwise launch
    ``num_servers`` servers from the SGLang environment (``python``, default ``.venv-sglang``).
    ``router``: put an sglang-router in front for generation (admin calls still go to every
    worker). ``weight_sync``: ``disk`` (workers read the checkpoint) or ``distributed``
    (broadcast over ``dist_backend``: gloo, or nccl with ``device: cuda`` only).
    ``pause_mode``: what ``pause_generation`` does to in-flight requests during a weight update
    (``abort``: they are re-issued afterwards, so a sample never mixes weight versions;
    ``retract``/``in_place``: they resume on new weights).
    ``request_batch_size``: prompts per ``/generate`` call (SGLang's batch form; 1 = one call
    per sample, as slime sends them), at most ``concurrency`` calls in flight. On CPU the
    per-call cost dominates: 256 quickstart samples took 2.0-2.4 s one call each, 0.65 s in
    calls of 8 (docs/sglang.md).
    """

    num_servers: int = 1
    urls: list[str] = field(default_factory=list)
    router: bool = False
    python: str | None = None
    device: str = "cpu"
    max_total_tokens: int = 65536
    extra_server_args: list[str] = field(default_factory=list)
    concurrency: int = 32
    request_batch_size: int = 8
    weight_sync: str = "disk"
    dist_backend: str = "gloo"
    bucket_mb: int = 256
    pause_mode: str = "abort"
    startup_timeout_s: float = 300.0
    health_interval_s: float = 5.0
    health_timeout_s: float = 30.0
    health_failures: int = 2
    max_request_attempts: int = 10
    request_timeout_s: float = 3600.0
    log_dir: str | None = None

    def __post_init__(self) -> None:
        if self.weight_sync not in ("disk", "distributed"):
            raise ValueError(f"rollout.sglang.weight_sync: {self.weight_sync!r} is not disk|distributed")
        if self.dist_backend not in ("gloo", "nccl"):
            raise ValueError(f"rollout.sglang.dist_backend: {self.dist_backend!r} is not gloo|nccl")
        if self.pause_mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"rollout.sglang.pause_mode: {self.pause_mode!r} is not abort|retract|in_place")
        if not self.urls and self.num_servers < 1:
            raise ValueError("rollout.sglang.num_servers must be >= 1 when no urls are given")
        if self.concurrency < 1:
            raise ValueError("rollout.sglang.concurrency must be >= 1")
        if self.request_batch_size < 1:
            raise ValueError("rollout.sglang.request_batch_size must be >= 1")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> SGLangConfig:
        """Build from a dict, naming any unknown key."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"rollout.sglang: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


def section(cfg: Any) -> Mapping[str, Any]:
    """The ``rollout.sglang`` mapping from a whole config (dict, pydantic model or object) or
    from the section itself (anything without a ``rollout`` entry)."""
    def as_dict(obj: Any) -> Mapping[str, Any] | None:
        if obj is None or isinstance(obj, Mapping):
            return obj
        if hasattr(obj, "model_dump"):
            return obj.model_dump()
        if hasattr(obj, "__dict__"):
            return {k: v for k, v in vars(obj).items() if not k.startswith("_")}
        raise TypeError(f"rollout.sglang: cannot read a config of type {type(obj).__name__}")

    top = as_dict(cfg) or {}
    if "rollout" in top:
        top = as_dict(top["rollout"]) or {}
        return as_dict(top.get("sglang")) or {}
    return top
