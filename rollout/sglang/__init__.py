"""The SGLang rollout engine: real SGLang servers (launched or given by URL), optional
sglang-router, weight sync from disk or over torch.distributed, and a health monitor.

Server processes run from the SGLang environment built by ``scripts/setup_sglang.sh``
(``.venv-sglang``); this package itself only needs httpx and torch.
"""

from rollout.sglang.batch import RolloutBatch
from rollout.sglang.config import SGLangConfig
from rollout.sglang.engine import SGLangEngine

__all__ = ["RolloutBatch", "SGLangConfig", "SGLangEngine"]
