"""The embedded trainer: an HF causal LM trained with torch AdamW on CPU (or one GPU).

One ``train`` call consumes one rollout batch: old log-probs are computed first (slime's
"log-prob time"), advantages from the rewards, then ``len(batch) / global_batch_size`` optimizer
steps, each accumulating gradients over micro-batches.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from infra.config import TrainerConfig
from infra.faults import fault_point
from infra.modeling import load_model
from trainers import algorithms as alg
from trainers.base import TrainBatch

STATE_FILE = "trainer_state.pt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


@dataclass
class PaddedBatch:
    """Right-padded prompt+response sequences and the response-token view into them."""

    input_ids: torch.Tensor        # [B, L]
    attention_mask: torch.Tensor   # [B, L]
    response_index: torch.Tensor   # [B, T] position in logits predicting response token t
    response_ids: torch.Tensor     # [B, T]
    mask: torch.Tensor             # [B, T] float, 1 on trained response tokens
    rollout_logprobs: torch.Tensor  # [B, T]

    def select(self, idx: torch.Tensor) -> PaddedBatch:
        return PaddedBatch(*(t[idx] for t in (self.input_ids, self.attention_mask,
                                              self.response_index, self.response_ids, self.mask,
                                              self.rollout_logprobs)))


def pad_batch(batch: TrainBatch, pad_id: int) -> PaddedBatch:
    n = len(batch)
    seqs = [p + r for p, r in zip(batch.prompt_token_ids, batch.response_token_ids, strict=True)]
    width = max(len(s) for s in seqs)
    resp_width = max(1, max(len(r) for r in batch.response_token_ids))
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    response_index = torch.zeros((n, resp_width), dtype=torch.long)
    response_ids = torch.zeros((n, resp_width), dtype=torch.long)
    mask = torch.zeros((n, resp_width))
    rollout_lp = torch.zeros((n, resp_width))
    for i, (prompt, resp) in enumerate(zip(batch.prompt_token_ids, batch.response_token_ids, strict=True)):
        seq = prompt + resp
        input_ids[i, :len(seq)] = torch.tensor(seq)
        attention_mask[i, :len(seq)] = 1
        r = len(resp)
        if r == 0:
            continue
        response_index[i, :r] = torch.arange(len(prompt) - 1, len(prompt) - 1 + r)
        response_ids[i, :r] = torch.tensor(resp)
        mask[i, :r] = torch.tensor(batch.loss_mask[i][:r] if batch.loss_mask[i] else [1] * r,
                                   dtype=torch.float32)
        lps = batch.rollout_logprobs[i]
        if lps:
            rollout_lp[i, :r] = torch.tensor(lps[:r], dtype=torch.float32)
    return PaddedBatch(input_ids, attention_mask, response_index, response_ids, mask, rollout_lp)


def response_logprobs(model: torch.nn.Module, pb: PaddedBatch, temperature: float = 1.0,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_t | x, y_<t) for every response token: log_softmax(logits / T) gathered at y_t.

    Returns ([B, T] log-probs, [B, T] entropy or None).
    """
    logits = model(input_ids=pb.input_ids, attention_mask=pb.attention_mask).logits
    idx = pb.response_index[..., None].expand(-1, -1, logits.shape[-1])
    resp_logits = logits.gather(1, idx) / temperature
    logp = torch.log_softmax(resp_logits.float(), dim=-1)
    token_logp = logp.gather(-1, pb.response_ids[..., None]).squeeze(-1)
    entropy = alg.entropy_from_logits(resp_logits) if with_entropy else None
    return token_logp, entropy


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


class TorchTrainer:
    """Policy (HF model) + AdamW. ``weight_version`` counts completed ``train`` calls."""

    def __init__(self, model_dir: str, cfg: TrainerConfig, n_samples_per_prompt: int,
                 rollout_temperature: float = 1.0, weight_version: int = 0, pad_token_id: int = 0):
        self.cfg = cfg
        self.model_dir = model_dir
        self.n_samples_per_prompt = n_samples_per_prompt
        self.temperature = rollout_temperature
        self.pad_token_id = pad_token_id
        self.model = load_model(model_dir).train()
        self.weight_version = weight_version
        self.optimizer = self._make_optimizer(cfg.lr)

    def _make_optimizer(self, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=self.cfg.weight_decay,
                                 betas=(self.cfg.adam_beta1, self.cfg.adam_beta2))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    # ---- RL ----
    def train(self, batch: TrainBatch) -> dict[str, float]:
        cfg = self.cfg
        pb = pad_batch(batch, self.pad_token_id)
        rewards = torch.tensor(batch.rewards, dtype=torch.float32)
        with torch.no_grad():
            old_logp, _ = response_logprobs(self.model, pb, self.temperature)
        advantages = self._advantages(rewards, pb.mask)
        n = len(batch)
        step_size = min(cfg.global_batch_size, n)
        micro = min(cfg.micro_batch_size, step_size)
        totals: dict[str, float] = {}
        steps = 0
        for start in range(0, n - step_size + 1, step_size):
            self.optimizer.zero_grad(set_to_none=True)
            step_idx = torch.arange(start, start + step_size)
            for m0 in range(0, step_size, micro):
                idx = step_idx[m0:m0 + micro]
                loss, terms = self._policy_loss(pb.select(idx), old_logp[idx], advantages[idx])
                (loss * len(idx) / step_size).backward()
                for k, v in terms.items():
                    totals[k] = totals.get(k, 0.0) + v * len(idx) / step_size
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_grad)
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + float(grad_norm)
            self.optimizer.step()
            steps += 1
        self.weight_version += 1
        metrics = {k: v / steps for k, v in totals.items()}
        masked_adv = advantages[pb.mask > 0]
        metrics.update(
            lr=cfg.lr, optimizer_steps=float(steps),
            advantage_mean=float(masked_adv.mean()) if masked_adv.numel() else 0.0,
            advantage_std=float(masked_adv.std()) if masked_adv.numel() > 1 else 0.0,
            train_rollout_logprob_abs_diff=_masked_abs_diff(old_logp, pb.rollout_logprobs, pb.mask))
        return metrics

    def _advantages(self, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        adv = alg.grpo_advantages(rewards, self.n_samples_per_prompt,
                                  normalize_std=not self.cfg.disable_grpo_std_normalization)
        return adv[:, None] * mask

    def _policy_loss(self, pb: PaddedBatch, old_logp: torch.Tensor,
                     advantages: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.cfg
        logp, entropy = response_logprobs(self.model, pb, self.temperature,
                                          with_entropy=True)
        pg, clipped = alg.compute_policy_loss(logp, old_logp, advantages, cfg.eps_clip,
                                              cfg.eps_clip_high, cfg.eps_clip_c)
        agg = cfg.loss_aggregation
        pg_loss = alg.aggregate_loss(pg, pb.mask, agg)
        entropy_loss = alg.aggregate_loss(entropy, pb.mask, agg)
        loss = pg_loss - cfg.entropy_coef * entropy_loss
        with torch.no_grad():
            ppo_kl = alg.aggregate_loss(old_logp - logp, pb.mask, agg)
            clipfrac = alg.aggregate_loss(clipped, pb.mask, agg)
        return loss, {"pg_loss": float(pg_loss), "pg_clipfrac": float(clipfrac),
                      "ppo_kl": float(ppo_kl), "entropy_loss": float(entropy_loss)}

    # ---- SFT ----
    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step of  -mean_t log pi(y_t | x, y_<t)  over masked response tokens."""
        pb = pad_batch(batch, self.pad_token_id)
        self.optimizer.zero_grad(set_to_none=True)
        logp, _ = response_logprobs(self.model, pb)
        loss = -alg.aggregate_loss(logp, pb.mask, "token_mean")
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)
        self.optimizer.step()
        return {"sft_loss": float(loss), "grad_norm": float(grad_norm)}

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # ---- checkpoints ----
    def save(self, checkpoint_dir: str) -> None:
        """HF checkpoint (+ tokenizer files) and trainer_state.pt, written to a temp folder and
        renamed into place, so a crash never leaves a half-written version."""
        final = Path(checkpoint_dir)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp)
        for name in TOKENIZER_FILES:
            src = Path(self.model_dir) / name
            if src.exists():
                shutil.copy(src, tmp / name)
        torch.save({"optimizer": self.optimizer.state_dict(), "weight_version": self.weight_version,
                    "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                    "numpy_rng": np.random.get_state()}, tmp / STATE_FILE)
        fault_point("during_checkpoint_save")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)

    def load(self, checkpoint_dir: str) -> None:
        self.model = load_model(checkpoint_dir).train()
        self.model_dir = checkpoint_dir
        self.optimizer = self._make_optimizer(self.cfg.lr)
        state_path = Path(checkpoint_dir) / STATE_FILE
        if state_path.exists():
            state = torch.load(state_path, weights_only=False)
            self.optimizer.load_state_dict(state["optimizer"])
            self.weight_version = state["weight_version"]
            torch.set_rng_state(state["torch_rng"])
            random.setstate(state["python_rng"])
            np.random.set_state(state["numpy_rng"])


def _masked_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """mean over masked tokens of |a - b| (train vs rollout log-prob mismatch)."""
    denom = mask.sum()
    return float(((a - b).abs() * mask).sum() / denom) if denom > 0 else 0.0
