"""The trainer interface shared by the torch and the Megatron-core backends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import pyarrow as pa


@dataclass
class TrainBatch:
    """A training slice in the trainer's terms: ragged lists, one entry per sample.

    Built from the lake's ``trajectories`` rows (``TrainBatch.from_arrow``). Groups are
    consecutive runs of ``n_samples_per_prompt`` samples sharing a ``group_key``.
    """

    sample_uids: list[str]
    prompt_token_ids: list[list[int]]
    response_token_ids: list[list[int]]
    loss_mask: list[list[int]]
    rollout_logprobs: list[list[float]]
    rewards: list[float]
    group_keys: list[str]
    weight_versions: list[int]

    def __len__(self) -> int:
        return len(self.sample_uids)

    @classmethod
    def from_arrow(cls, table: pa.Table) -> TrainBatch:
        """Rows sorted by (iteration, group_index, sample_index) so groups are consecutive."""
        table = table.sort_by([("iteration", "ascending"), ("group_index", "ascending"),
                               ("sample_index", "ascending")])
        cols = table.to_pydict()
        return cls(
            sample_uids=cols["sample_uid"],
            prompt_token_ids=cols["prompt_token_ids"],
            response_token_ids=cols["response_token_ids"],
            loss_mask=cols["loss_mask"],
            rollout_logprobs=cols["rollout_logprobs"],
            rewards=[0.0 if r is None else float(r) for r in cols["reward"]],
            group_keys=[f"{r}/{i}/{g}" for r, i, g in zip(cols["run_id"], cols["iteration"],
                                                        cols["group_index"], strict=True)],
            weight_versions=cols["weight_version"],
        )


@runtime_checkable
class Trainer(Protocol):
    """Owns the policy (and optimizer, critic, reference model when configured)."""

    weight_version: int

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One RL training call on a rollout batch (possibly several optimizer steps);
        returns metrics with slime's names (pg_loss, pg_clipfrac, ppo_kl, grad_norm, ...).
        Increments ``weight_version`` by one."""

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        """Supervised step(s) on response tokens (``loss_type: sft``)."""

    def save(self, checkpoint_dir: str) -> None:
        """Write the policy as an HF checkpoint (config + safetensors + tokenizer) plus the
        trainer state (optimizer, RNG, weight_version) needed to resume."""

    def load(self, checkpoint_dir: str) -> None:
        """Restore what ``save`` wrote."""
