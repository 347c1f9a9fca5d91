"""The Sample: one generated trajectory, with slime's field names.

A Sample maps one-to-one onto a row of the lake's ``trajectories`` table
(see ``buffer.schema``): ``Sample.to_row`` / ``Sample.from_row`` are the only bridge. slime's
fields without a column of their own (``weight_versions``, ``remove_sample``, ``train_metadata``,
``session_id``, ``non_generation_time``, ``generate_function_path``, ``engine``, a chat-message
prompt) travel in the JSON ``metadata`` column under the reserved key ``"_sample"``; ``from_row`` takes them
back out, so ``from_row(to_row(s)) == s``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Sample:
    """One prompt + one generated response, scored.

    ``tokens`` is prompt + response token ids (as in slime); ``prompt_token_ids`` and
    ``response_token_ids`` are its two parts. ``loss_mask`` and ``rollout_log_probs`` run over
    the response tokens only.
    """

    group_index: int
    index: int
    prompt: str | list[dict[str, Any]]
    prompt_token_ids: list[int]
    label: str | None = None
    response: str = ""
    response_token_ids: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    reward: float | None = None
    reward_detail: dict[str, Any] = field(default_factory=dict)
    status: Status = Status.PENDING
    finish_reason: str | None = None
    weight_version: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    data_source: str | None = None
    row: int | None = None
    # slime's fields kept in metadata["_sample"] in the lake
    weight_versions: list[int] = field(default_factory=list)
    remove_sample: bool = False
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0
    generate_function_path: str | None = None
    engine: str | None = None  # the engine that generated it, when it is not the run's engine

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.response_token_ids

    @property
    def response_length(self) -> int:
        return len(self.response_token_ids)

    def to_row(self, run_id: str, iteration: int, engine: str, kind: str = "train") -> dict[str, Any]:
        """The ``trajectories`` row for this sample (created_at is stamped by the lake)."""
        extra = {k: getattr(self, k) for k, default in _EXTRA_DEFAULTS.items()
                 if getattr(self, k) != default}
        if not isinstance(self.prompt, str):
            extra["prompt_messages"] = True
        metadata = {**self.metadata, SAMPLE_KEY: extra} if extra else self.metadata
        return {
            "sample_uid": sample_uid(run_id, iteration, self.index, kind),
            "run_id": run_id,
            "iteration": iteration,
            "weight_version": self.weight_version,
            "group_index": self.group_index,
            "sample_index": self.index,
            "kind": kind,
            "prompt": self.prompt if isinstance(self.prompt, str) else json.dumps(self.prompt),
            "prompt_token_ids": list(self.prompt_token_ids),
            "response": self.response,
            "response_token_ids": list(self.response_token_ids),
            "rollout_logprobs": [float(x) for x in self.rollout_log_probs],
            "loss_mask": [int(x) for x in self.loss_mask],
            "reward": None if self.reward is None else float(self.reward),
            "reward_detail": detail_json(self.reward_detail),
            "label": self.label,
            "status": Status(self.status).value,
            "finish_reason": self.finish_reason,
            "metadata": json.dumps(metadata, default=str),
            "engine": self.engine or engine,
            "data_source": self.data_source,
            "row": self.row,
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Sample:
        """The sample a row holds; a non-finite or too large reward (written before rewards
        were checked) comes back as a failed sample, as scoring marks one today."""
        metadata = json.loads(row.get("metadata") or "{}")
        extra = metadata.pop(SAMPLE_KEY, {})
        prompt = row["prompt"]
        if extra.pop("prompt_messages", False):
            prompt = json.loads(prompt)
        reward, detail = row.get("reward"), json.loads(row.get("reward_detail") or "{}")
        status = Status(row.get("status") or "pending")
        if reward is not None and not usable_reward(reward):
            reward, detail, status = 0.0, {"error": unusable_reward_reason(reward)}, Status.FAILED
        return cls(
            group_index=row["group_index"],
            index=row["sample_index"],
            prompt=prompt,
            prompt_token_ids=list(row["prompt_token_ids"]),
            label=row.get("label"),
            response=row.get("response") or "",
            response_token_ids=list(row.get("response_token_ids") or []),
            rollout_log_probs=list(row.get("rollout_logprobs") or []),
            loss_mask=list(row.get("loss_mask") or []),
            reward=reward,
            reward_detail=detail,
            status=status,
            finish_reason=row.get("finish_reason"),
            weight_version=row.get("weight_version", 0),
            metadata=metadata,
            data_source=row.get("data_source"),
            row=row.get("row"),
            **{k: v for k, v in extra.items() if k in _EXTRA_DEFAULTS},
        )


def detail_json(detail: dict[str, Any]) -> str:
    """The ``reward_detail`` column's text: NumPy (or torch) numbers and arrays as JSON numbers
    and lists (their ``tolist()``: a ``np.float32`` score was stored as the text "0.5"), other
    values JSON cannot hold (a set) as their ``str``; a key that is not a string or number, or a
    cycle, raises (TypeError, ValueError), which scoring checks first (``rewards.registry``) to
    fail only that sample."""
    return json.dumps(detail, default=_plain)


def _plain(value: Any) -> Any:
    to_list = getattr(value, "tolist", None)
    if callable(to_list):
        try:
            return to_list()
        except Exception:  # noqa: BLE001 - anything else with a tolist: its text, as before
            pass
    return str(value)


# The largest reward magnitude accepted. Rewards train as float32 (trainers/torch_trainer.py) and
# are squared in statistics (PPO's value loss, whitening, the rollout metrics' std): 1e15 squared
# is 1e30, which summed over 1e8 tokens stays below float32's largest number (3.4e38). A larger
# one (1e308 passed the NaN/inf check) became inf there, or stopped the run in the metrics' fsum.
MAX_ABS_REWARD = 1e15


def nonfinite_reason(reward: float) -> str:
    return f"reward is {'NaN' if math.isnan(reward) else reward} (not a finite number)"


def too_large_reason(shown: str) -> str:
    return (f"reward {shown} too large: |reward| must be <= {MAX_ABS_REWARD:g} "
            "(rewards train as float32 and are squared in statistics)")


def usable_reward(reward: float) -> bool:
    """Finite and at most ``MAX_ABS_REWARD`` in magnitude."""
    return math.isfinite(reward) and abs(reward) <= MAX_ABS_REWARD


def unusable_reward_reason(reward: float) -> str:
    """Why a reward that is not ``usable_reward`` is refused."""
    return nonfinite_reason(reward) if not math.isfinite(reward) else too_large_reason(f"{reward:g}")


def train_reward(reward: float | None) -> float:
    """The reward a sample trains with: a failed or missing one (None, NaN, +-inf, or one over
    ``MAX_ABS_REWARD`` from a lake written before that check) is 0.0, so its group still trains
    (the same rule as ``rewards.registry.score_samples``)."""
    return float(reward) if reward is not None and usable_reward(reward) else 0.0


def sample_uid(run_id: str, iteration: int, index: int, kind: str = "train") -> str:
    """``{run_id}/{iteration}/{index}``; eval samples get ``{run_id}/eval-{iteration}/{index}``."""
    step = str(iteration) if kind == "train" else f"{kind}-{iteration}"
    return f"{run_id}/{step}/{index}"


SAMPLE_KEY = "_sample"
_EXTRA_DEFAULTS: dict[str, Any] = {"weight_versions": [], "remove_sample": False,
                                   "train_metadata": None, "session_id": None,
                                   "non_generation_time": 0.0, "generate_function_path": None,
                                   "engine": None}
