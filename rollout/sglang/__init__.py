"""The SGLang rollout engine: real SGLang servers (launched or given by URL), optional
sglang-router, weight sync from disk or over torch.distributed, and a health monitor.

Server processes run from the SGLang environment built by ``scripts/setup_sglang.sh``
(``.venv-sglang``); this package itself only needs httpx and torch.

The names below load on first use: ``infra.config`` reads ``rollout.sglang.config`` (the
section's keys) when a config is loaded, and must not import torch and httpx for that.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"RolloutBatch": "rollout.sglang.batch", "SGLangConfig": "rollout.sglang.config",
         "SGLangEngine": "rollout.sglang.engine"}

__all__ = ["RolloutBatch", "SGLangConfig", "SGLangEngine"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
