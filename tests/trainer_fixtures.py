"""Shared helpers for the trainer tests: a tiny random Qwen2 on disk and synthetic batches."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from infra.config import TinyModelConfig, TrainerConfig
from infra.modeling import build_tiny_model
from trainers.base import TrainBatch
from trainers.torch_trainer import TorchTrainer, pad_batch, response_logprobs

TINY = TinyModelConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                       num_key_value_heads=1, intermediate_size=64, max_position_embeddings=32)
VOCAB_LO, VOCAB_HI = 4, 30  # ordinary characters of the char tokenizer


def build_model(tmp: Path) -> str:
    return str(build_tiny_model(tmp / "tiny", TINY, seed=0))


def make_batch(rewards: list[float], response_lengths: list[int] | None = None, seed: int = 0,
               prompt_length: int = 4, rollout_logprobs: list[list[float]] | None = None,
               group_size: int = 4) -> TrainBatch:
    """Random prompts and responses (consecutive groups of ``group_size`` in order), the given
    rewards."""
    rng = random.Random(seed)
    n = len(rewards)
    lengths = response_lengths or [rng.randint(2, 5) for _ in range(n)]
    prompts = [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(prompt_length)] for _ in range(n)]
    responses = [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(k)] for k in lengths]
    return TrainBatch(
        sample_uids=[f"t/{i}" for i in range(n)], prompt_token_ids=prompts,
        response_token_ids=responses, loss_mask=[[1] * k for k in lengths],
        rollout_logprobs=rollout_logprobs or [[] for _ in range(n)], rewards=list(rewards),
        group_keys=[f"g{i // group_size}" for i in range(n)], weight_versions=[0] * n)


def trainer(model_dir: str, n_samples_per_prompt: int, **overrides) -> TorchTrainer:
    cfg = TrainerConfig(**{"lr": 1e-2, "global_batch_size": 256, "micro_batch_size": 256,
                           **overrides})
    return TorchTrainer(model_dir, cfg, n_samples_per_prompt, pad_token_id=0)


def logprobs(tr: TorchTrainer, batch: TrainBatch) -> torch.Tensor:
    """[B, T] log-probs of the batch's response tokens under the trainer's policy."""
    with torch.no_grad():
        return response_logprobs(tr.model, pad_batch(batch, 0))[0]


def sequence_logprobs(tr: TorchTrainer, batch: TrainBatch) -> torch.Tensor:
    """[B] sum over response tokens of log pi."""
    pb = pad_batch(batch, 0)
    return (logprobs(tr, batch) * pb.mask).sum(dim=-1)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
