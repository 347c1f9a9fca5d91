"""The Sample: one generated trajectory, with slime's field names.

A Sample maps one-to-one onto a row of the lake's ``trajectories`` table
(see ``buffer.schema``): ``Sample.to_row`` / ``Sample.from_row`` are the only bridge.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Status(str, Enum):
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
    prompt: str
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

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.response_token_ids

    @property
    def response_length(self) -> int:
        return len(self.response_token_ids)

    def to_row(self, run_id: str, iteration: int, engine: str, kind: str = "train") -> dict[str, Any]:
        """The ``trajectories`` row for this sample (created_at is stamped by the lake)."""
        return {
            "sample_uid": sample_uid(run_id, iteration, self.index, kind),
            "run_id": run_id,
            "iteration": iteration,
            "weight_version": self.weight_version,
            "group_index": self.group_index,
            "sample_index": self.index,
            "kind": kind,
            "prompt": self.prompt,
            "prompt_token_ids": list(self.prompt_token_ids),
            "response": self.response,
            "response_token_ids": list(self.response_token_ids),
            "rollout_logprobs": [float(x) for x in self.rollout_log_probs],
            "loss_mask": [int(x) for x in self.loss_mask],
            "reward": None if self.reward is None else float(self.reward),
            "reward_detail": json.dumps(self.reward_detail, default=str),
            "label": self.label,
            "status": Status(self.status).value,
            "finish_reason": self.finish_reason,
            "metadata": json.dumps(self.metadata, default=str),
            "engine": engine,
            "data_source": self.data_source,
            "row": self.row,
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Sample:
        return cls(
            group_index=row["group_index"],
            index=row["sample_index"],
            prompt=row["prompt"],
            prompt_token_ids=list(row["prompt_token_ids"]),
            label=row.get("label"),
            response=row.get("response") or "",
            response_token_ids=list(row.get("response_token_ids") or []),
            rollout_log_probs=list(row.get("rollout_logprobs") or []),
            loss_mask=list(row.get("loss_mask") or []),
            reward=row.get("reward"),
            reward_detail=json.loads(row.get("reward_detail") or "{}"),
            status=Status(row.get("status") or "pending"),
            finish_reason=row.get("finish_reason"),
            weight_version=row.get("weight_version", 0),
            metadata=json.loads(row.get("metadata") or "{}"),
            data_source=row.get("data_source"),
            row=row.get("row"),
        )


def sample_uid(run_id: str, iteration: int, index: int, kind: str = "train") -> str:
    """``{run_id}/{iteration}/{index}``; eval samples get ``{run_id}/eval-{iteration}/{index}``."""
    step = str(iteration) if kind == "train" else f"{kind}-{iteration}"
    return f"{run_id}/{step}/{index}"
