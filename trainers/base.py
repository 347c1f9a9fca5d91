"""The trainer interface shared by the torch and the Megatron-core backends."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable

import pyarrow as pa
import torch

from rollout.sample import train_reward

# the trajectory columns a TrainBatch is built from
BATCH_COLUMNS = ("sample_uid", "prompt_token_ids", "response_token_ids", "loss_mask",
                 "rollout_logprobs", "reward", "run_id", "iteration", "group_index", "weight_version")


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

    def check_groups(self, n_samples_per_prompt: int) -> None:
        """Raise ValueError unless the rows are consecutive groups of exactly
        ``n_samples_per_prompt`` samples, each group one ``group_key``: the advantages and
        pass@k read groups as consecutive runs of n rows, so an uneven group (a rollout function
        returning 5 and 3 samples for n = 4) was normalised across two prompts without a word
        (review, 2026-11-29)."""
        n, keys = n_samples_per_prompt, self.group_keys
        uneven = {k: c for k, c in Counter(keys).items() if c != n}
        # with every key n times, runs of n rows each of one key are one group per key
        if uneven or any(keys[i] != keys[i - i % n] for i in range(len(keys))):
            example = ", ".join(f"{k}: {c}" for k, c in list(uneven.items())[:3])
            raise ValueError(
                f"the training batch's groups are not {n} samples each "
                f"(rollout.n_samples_per_prompt){': ' + example if example else ''}: "
                "a group's advantages are taken over its own samples only")

    @classmethod
    def from_arrow(cls, table: pa.Table) -> TrainBatch:
        """Rows sorted by (iteration, group_index, sample_index) so groups are consecutive; a
        missing or non-finite reward (a failed sample, or an inf row from an older lake) is 0.0."""
        # only the columns used: a trajectory row also holds its texts, reward detail, metadata
        table = table.select([*BATCH_COLUMNS, "sample_index"])
        cols = table.sort_by([("iteration", "ascending"), ("group_index", "ascending"),
                              ("sample_index", "ascending")]).to_pydict()
        return cls(
            sample_uids=cols["sample_uid"],
            prompt_token_ids=cols["prompt_token_ids"],
            response_token_ids=cols["response_token_ids"],
            loss_mask=cols["loss_mask"],
            rollout_logprobs=cols["rollout_logprobs"],
            rewards=[train_reward(r) for r in cols["reward"]],
            group_keys=[f"{r}/{i}/{g}" for r, i, g in zip(cols["run_id"], cols["iteration"],
                                                        cols["group_index"], strict=True)],
            weight_versions=cols["weight_version"],
        )


@dataclass
class PaddedBatch:
    """Right-padded prompt+response sequences and the response-token view into them (both
    backends train on this)."""

    input_ids: torch.Tensor        # [B, L]
    attention_mask: torch.Tensor   # [B, L]
    response_index: torch.Tensor   # [B, T] position in logits predicting response token t
    response_ids: torch.Tensor     # [B, T]
    mask: torch.Tensor             # [B, T] float, 1 on trained response tokens
    rollout_logprobs: torch.Tensor  # [B, T] (0 where the engine reported none)
    has_rollout_logprobs: torch.Tensor  # [B] float, 1 where the engine reported log-probs
    prompt_len: torch.Tensor       # [B] long, prompt tokens of each row

    def _map(self, fn) -> PaddedBatch:
        return PaddedBatch(*(fn(getattr(self, f.name)) for f in fields(self)))

    def select(self, idx: torch.Tensor) -> PaddedBatch:
        return self._map(lambda t: t[idx])

    def to(self, device: torch.device | str) -> PaddedBatch:
        return self._map(lambda t: t.to(device))


def pad_batch(batch: TrainBatch, pad_id: int) -> PaddedBatch:
    """Right-pad prompt+response; response token t of row i is predicted at position
    len(prompt_i) - 1 + t. An empty ``loss_mask`` means every response token is trained.
    Rows are padded as Python lists and each field becomes one tensor (a tensor per row and
    field cost ~21 ms for a 256-row batch: a tenth of an iteration's training here)."""
    n = len(batch)
    if n == 0:
        raise ValueError("TrainBatch is empty: nothing to train on")
    width = max(len(p) + len(r) for p, r in zip(batch.prompt_token_ids, batch.response_token_ids,
                                                strict=True))
    resp_width = max(1, max(len(r) for r in batch.response_token_ids))
    input_ids, attention_mask, response_index, response_ids, mask, rollout_lp, has_lp = \
        [], [], [], [], [], [], []
    for uid, prompt, resp, loss_mask, lps in zip(
            batch.sample_uids, batch.prompt_token_ids, batch.response_token_ids, batch.loss_mask,
            batch.rollout_logprobs, strict=True):
        if not prompt:
            raise ValueError(f"sample {uid}: empty prompt_token_ids")
        length, r = len(prompt) + len(resp), len(resp)
        input_ids.append([*prompt, *resp, *[pad_id] * (width - length)])
        attention_mask.append([1] * length + [0] * (width - length))
        tail = [0] * (resp_width - r)
        response_index.append([*range(len(prompt) - 1, len(prompt) - 1 + r), *tail])
        response_ids.append([*resp, *tail])
        trained = list(loss_mask[:r]) if loss_mask else [1] * r
        if len(trained) != r:
            raise ValueError(f"sample {uid}: loss_mask has {len(trained)} entries for {r} "
                             "response tokens")
        mask.append(trained + tail)
        logprobs = list(lps[:r]) if lps else []
        rollout_lp.append(logprobs + [0.0] * (resp_width - len(logprobs)))
        has_lp.append(1.0 if logprobs else 0.0)
    return PaddedBatch(
        torch.tensor(input_ids, dtype=torch.long), torch.tensor(attention_mask, dtype=torch.long),
        torch.tensor(response_index, dtype=torch.long), torch.tensor(response_ids, dtype=torch.long),
        torch.tensor(mask, dtype=torch.float32), torch.tensor(rollout_lp, dtype=torch.float32),
        torch.tensor(has_lp, dtype=torch.float32),
        torch.tensor([len(p) for p in batch.prompt_token_ids], dtype=torch.long))


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
