"""The embedded trainer: an HF causal LM trained with torch AdamW on CPU (or one GPU).

One ``train`` call consumes one rollout batch: old log-probs (and the reference's log-probs
and the critic's values, when configured) are computed first (slime's "log-prob time"), then
advantages with ``algorithms.compute_advantages``, then ``ceil(len(batch) / global_batch_size)``
optimizer steps, each accumulating gradients over micro-batches. With a single optimizer step
(and no KL in the reward) the old log-probs are the grad pass's own, detached: no separate
forward. The loss terms are in ``trainers.losses``, the critic in ``trainers.critic``, the
reference in ``trainers.reference``; formulas and choices: docs/algorithms.md. On CUDA
(``device``/``dtype``): fp32 master weights and AdamW state under bf16 autocast (docs/gpu.md).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from infra.config import TrainerConfig
from infra.modeling import load_model
from trainers import algorithms as alg
from trainers import losses
from trainers.adamw import Optimizer, make_adamw
from trainers.base import PaddedBatch, TrainBatch, pad_batch
from trainers.checkpoint import CHAT_TEMPLATE_DIR, CheckpointWriter, Snapshot, read_files
from trainers.critic import (
    CRITIC_FILE,
    ValueModel,
    critic_state,
    load_critic,
    make_critic_optimizer,
    response_values,
)
from trainers.logprobs import chunked_logprobs, linear_head
from trainers.losses import micro_weight
from trainers.reference import load_reference, needs_reference
from trainers.shared_prompt import response_hidden

STATE_FILE = "trainer_state.pt"
# every file a HF tokenizer may load from (fast, slow BPE/WordPiece/SentencePiece, tiktoken,
# templates): a checkpoint holds those its model folder has, so it loads with AutoTokenizer and
# encodes as the base did (one whose tokenizer was vocab.json + merges.txt lost it)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "sentencepiece.model", "qwen.tiktoken",
                   "tokenizer.tiktoken", "preprocessor_config.json", "processor_config.json")


def tokenizer_file_names(folder: Path) -> tuple[str, ...]:
    """``TOKENIZER_FILES``, any ``*.tiktoken`` file ``folder`` has (named by the model) and the
    named chat templates transformers keeps in ``CHAT_TEMPLATE_DIR`` (relative paths)."""
    templates = sorted(p.relative_to(folder).as_posix()
                       for p in (folder / CHAT_TEMPLATE_DIR).glob("*.jinja"))
    return tuple(dict.fromkeys([*TOKENIZER_FILES, *(p.name for p in folder.glob("*.tiktoken")),
                                *templates]))


def response_logprobs(model: torch.nn.Module, pb: PaddedBatch, temperature: float = 1.0,
                      with_entropy: bool = False, entropy_grad: bool = True,
                      vocab_chunk_size: int | None = None, share_prompt: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_t | x, y_<t) for every response token: log_softmax(logits / T) gathered at y_t.

    Returns ([B, T] log-probs, [B, T] entropy or None); the entropy is detached unless
    ``entropy_grad`` (it only needs a gradient when entropy_coef != 0). With a plain Linear
    output head only the response positions' hidden states go through it; with
    ``vocab_chunk_size`` too, ``vocab_chunk_size`` vocabulary ids at a time
    (``trainers.logprobs``): no [B, L, V] logits are ever built. ``share_prompt``: rows with
    the same prompt run it once (``trainers.shared_prompt``).
    """
    head = linear_head(model)
    if head is None:  # the model's own logits, every position
        logits = model(input_ids=pb.input_ids, attention_mask=pb.attention_mask).logits
        idx = pb.response_index[..., None].expand(-1, -1, logits.shape[-1])
        return _logprobs_from_logits(logits.gather(1, idx) / temperature, pb.response_ids,
                                     with_entropy, entropy_grad)
    hidden = response_hidden(model.base_model, pb, share_prompt)
    if not vocab_chunk_size:
        return _logprobs_from_logits(head(hidden) / temperature, pb.response_ids, with_entropy,
                                     entropy_grad)
    logp, entropy = chunked_logprobs(hidden, head.weight, pb.response_ids, temperature,
                                     vocab_chunk_size)
    if not with_entropy:
        return logp, None
    return logp, entropy if entropy_grad else entropy.detach()


def _logprobs_from_logits(resp_logits: torch.Tensor, response_ids: torch.Tensor,
                          with_entropy: bool, entropy_grad: bool
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(z)[y] (and the entropy of softmax(z)) of tempered logits z [B, T, V]."""
    logp = torch.log_softmax(resp_logits.float(), dim=-1)
    token_logp = logp.gather(-1, response_ids[..., None]).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = alg.entropy_from_logits(resp_logits if entropy_grad else resp_logits.detach())
    return token_logp, entropy


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute every decoder layer in the backward (non-reentrant); transformers 5 renamed
    ``gradient_checkpointing_enable`` (now deprecated) to ``activation_checkpointing_enable``."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's generators from ``seed``. Without CUDA, torch's CPU
    generator alone: ``torch.manual_seed`` also seeds CUDA, XPU and MTIA lazily, each capturing
    the caller's stack (``traceback.format_stack``) while that device is not initialised, ~3 ms
    a call under a flow's deep stack, every iteration (2026-11-28, py-spy)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    if torch.cuda.is_available():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


class NonFiniteGradient(RuntimeError):
    """A gradient with inf or NaN: the step is refused before the optimizer applies it."""


def finite_grad_norm(model: torch.nn.Module, clip_grad: float, weight_version: int,
                     what: str = "gradient") -> float:
    """Clip the gradient to norm ``clip_grad`` (``clip_grad_norm_``) and return its norm before
    clipping; an inf or NaN norm raises ``NonFiniteGradient`` before any weight changes (a
    stepped NaN spreads to every weight, and the run went on to report success)."""
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad))
    if not math.isfinite(norm):
        raise NonFiniteGradient(f"the {what} at weight version {weight_version} is not finite "
                                f"(norm {norm}): the step is refused, nothing of it is committed; "
                                "check trainer.lr and the rewards")
    return norm


class TorchTrainer:
    """Policy (HF model) + AdamW; a critic (ppo) and a frozen reference (KL) when configured.

    ``weight_version`` counts completed ``train`` calls. ``reference_dir`` is where the frozen
    reference comes from when KL is used (default: ``model_dir``, the initial weights); the
    runtime passes checkpoint v0 (the SFT warm-up's output). ``trainer.ref_load`` overrides both.
    """

    def __init__(self, model_dir: str, cfg: TrainerConfig, n_samples_per_prompt: int,
                 rollout_temperature: float = 1.0, weight_version: int = 0, pad_token_id: int = 0,
                 reference_dir: str | None = None, device: str = "cpu", dtype: str = "fp32"):
        self.cfg = cfg
        self.device, self.dtype = device, dtype
        self.model_dir = model_dir
        self.reference_dir = cfg.ref_load or reference_dir or model_dir
        self.n_samples_per_prompt = n_samples_per_prompt
        self.temperature = rollout_temperature
        self.pad_token_id = pad_token_id
        self.model = self._load_policy(model_dir)
        self.weight_version = weight_version
        # one optimizer step per rollout: the grad pass's own log-probs are the old ones
        self.reuse_grad_pass_logprobs = True
        self.optimizer = self._make_optimizer(cfg.lr)
        self.critic: ValueModel | None = None
        self.critic_optimizer: Optimizer | None = None
        self._reference: torch.nn.Module | None = None
        # read once: the folder the trainer came from may be a checkpoint pruned later
        self._tokenizer_files = read_files(Path(model_dir), tokenizer_file_names(Path(model_dir)))
        self.checkpoint_writer = CheckpointWriter()

    def _load_policy(self, path: str) -> torch.nn.Module:
        """fp32 master weights on the device (bf16 runs under autocast, ``_compute``)."""
        model = load_model(path, self.device, "fp32").train()
        if self.cfg.recompute_granularity == "full":
            model.config.use_cache = False
            enable_activation_checkpointing(model)
        return model

    def _compute(self) -> torch.autocast:
        """bf16 autocast over fp32 master weights when dtype is bf16 (a no-op for fp32)."""
        return torch.autocast(device_type=self.device, dtype=torch.bfloat16,
                              enabled=self.dtype == "bf16")

    def _logprobs(self, model: torch.nn.Module, pb: PaddedBatch, **kw):
        with self._compute():
            return response_logprobs(model, pb, self.temperature,
                                     vocab_chunk_size=self.cfg.vocab_chunk_size,
                                     share_prompt=self.cfg.share_prompt_forward, **kw)

    def _make_optimizer(self, lr: float) -> Optimizer:
        return make_adamw(self.model.parameters(), lr, self.cfg.weight_decay,
                          (self.cfg.adam_beta1, self.cfg.adam_beta2), self.device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights as detached views (no copy): a consumer copies what it keeps
        (``TorchEngine.load_state_dict`` copies into its own parameters)."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    # ---- the optional models ----
    @property
    def uses_critic(self) -> bool:
        return self.cfg.loss_type == "policy_loss" and self.cfg.advantage_estimator == "ppo"

    @property
    def uses_reference(self) -> bool:
        return self.cfg.loss_type == "policy_loss" and needs_reference(
            self.cfg.use_kl_loss, self.cfg.kl_coef, self.cfg.advantage_estimator)

    def reference(self) -> torch.nn.Module:
        """The frozen reference, loaded from ``reference_dir`` on first use."""
        if self._reference is None:
            self._reference = load_reference(self.reference_dir, self.device, self.dtype)
        return self._reference

    def _critic_betas(self) -> tuple[float, float]:
        return (self.cfg.adam_beta1, self.cfg.adam_beta2)

    def _ensure_critic(self) -> ValueModel:
        """The critic; created from the current policy (normally version 0) on first use."""
        if self.critic is None:
            self.critic = ValueModel.from_policy(self.model)
            if self.cfg.recompute_granularity == "full":
                enable_activation_checkpointing(self.critic.backbone)
            self.critic_optimizer = make_critic_optimizer(
                self.critic, self.cfg.critic_lr or self.cfg.lr, self.cfg.weight_decay,
                self._critic_betas())
        return self.critic

    # ---- RL ----
    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One rollout batch: old log-probs (and reference log-probs, values) first, then
        advantages, then ceil(len(batch) / global_batch_size) optimizer steps over consecutive
        slices, each accumulating gradients over micro-batches of ``micro_batch_size``.
        ``loss_type: sft`` trains the SFT loss on the response tokens instead."""
        cfg = self.cfg
        if cfg.loss_type == "policy_loss":
            batch.check_groups(self.n_samples_per_prompt)
        pb = pad_batch(batch, self.pad_token_id).to(self.device)
        rewards = torch.tensor(batch.rewards, dtype=torch.float32, device=self.device)
        if cfg.use_tis and cfg.loss_type == "policy_loss":
            _check_rollout_logprobs(batch)
        if cfg.loss_type == "sft":
            pb, prep = self._prepare_sft(pb, rewards)
        else:
            prep = self._prepare(pb, rewards)
        metrics = self._optimize(pb, prep) if len(pb.mask) else {"optimizer_steps": 0.0}
        self.weight_version += 1
        metrics.update(prep.stats)
        if prep.old_logp is not None:
            metrics["train_rollout_logprob_abs_diff"] = _masked_abs_diff(
                prep.old_logp, pb.rollout_logprobs, pb.mask * pb.has_rollout_logprobs[:, None])
        return metrics

    def _old_logprobs_from_grad_pass(self, n: int) -> bool:
        """True when the policy cannot move between the rollout batch's old-log-prob pass and
        its grad pass: one optimizer step per batch (n <= global_batch_size) and nothing needs
        lp_old before that step (KL in the reward does). Then lp_old = lp.detach() of the grad
        pass itself, which is what the separate no-grad forward would compute (same weights,
        same rows, same micro-batches): ratio = 1, same loss and gradient, one forward less.
        Never the engine's log-probs: its weights/numerics may differ (bf16, other kernels)."""
        kl_in_reward = self.uses_reference and self.cfg.kl_coef > 0
        return self.reuse_grad_pass_logprobs and n <= self.cfg.global_batch_size \
            and not kl_in_reward

    def _prepare(self, pb: PaddedBatch, rewards: torch.Tensor) -> Prepared:
        """Everything fixed during the optimizer steps: lp_old, lp_ref, V_old, A, returns."""
        cfg = self.cfg
        micro = cfg.micro_batch_size
        from_grad_pass = self._old_logprobs_from_grad_pass(len(pb.mask))
        old_logp = None if from_grad_pass else _no_grad_chunks(
            lambda b: self._logprobs(self.model, b)[0], pb, micro)
        ref_logp = values = kl = None
        if self.uses_reference:
            ref = self.reference()
            ref_logp = _no_grad_chunks(lambda b: self._logprobs(ref, b)[0], pb, micro)
            if cfg.kl_coef > 0:
                kl = alg.compute_approx_kl(old_logp, ref_logp, cfg.kl_loss_type)
        if self.uses_critic:
            critic = self._ensure_critic()
            values = _no_grad_chunks(lambda b: self._values(critic, b), pb, micro)
        advantages, returns = alg.compute_advantages(
            cfg.advantage_estimator, rewards, pb.mask, self.n_samples_per_prompt, kl=kl,
            values=values, kl_coef=cfg.kl_coef, gamma=cfg.gamma, lambd=cfg.lambd,
            normalize_std=not cfg.disable_grpo_std_normalization,
            normalize_advantages=cfg.normalize_advantages)
        stats = {**_masked_stats("advantage", advantages, pb.mask),
                 **_masked_stats("return", returns, pb.mask)}
        if values is not None:
            stats.update(_masked_stats("value", values, pb.mask))
        if kl is not None:
            stats["reward_kl"] = float(alg.masked_mean(kl, pb.mask))
        if from_grad_pass:  # filled by the grad pass, micro-batch by micro-batch
            old_logp = torch.zeros_like(pb.mask)
        return Prepared(pb.mask, old_logp, advantages, returns, ref_logp, values, stats,
                        old_from_grad_pass=from_grad_pass)

    def _values(self, critic: ValueModel, pb: PaddedBatch) -> torch.Tensor:
        with self._compute():
            return response_values(critic, pb, self.cfg.share_prompt_forward)

    def _prepare_sft(self, pb: PaddedBatch, rewards: torch.Tensor) -> tuple[PaddedBatch, Prepared]:
        """SFT on the rollout responses; with ``sft_min_reward`` only the samples whose reward
        reaches it (rejection sampling): the others are left out of the batch, not kept as
        zero-mask rows, which ``sample_mean`` counted as samples: the loss and the step were
        scaled by the share kept (review, 2026-11-29). None kept: no optimizer step."""
        if self.cfg.sft_min_reward is not None:
            pb = pb.select(torch.nonzero(rewards >= self.cfg.sft_min_reward).flatten())
        kept = float((pb.mask.sum(dim=-1) > 0).sum())
        return pb, Prepared(pb.mask, stats={"sft_samples": kept})

    def _optimize(self, pb: PaddedBatch, prep: Prepared) -> dict[str, float]:
        cfg = self.cfg
        n = len(pb.mask)
        step_size = min(cfg.global_batch_size, n)
        micro = min(cfg.micro_batch_size, step_size)
        totals: dict[str, float] = {}
        steps = 0
        for start in range(0, n, step_size):
            step_idx = torch.arange(start, min(start + step_size, n), device=self.device)
            step_mask = prep.mask[step_idx]
            self.optimizer.zero_grad(set_to_none=True)
            if self.critic_optimizer is not None:
                self.critic_optimizer.zero_grad(set_to_none=True)
            for m0 in range(0, len(step_idx), micro):
                local = torch.arange(m0, min(m0 + micro, len(step_idx)), device=self.device)
                idx = step_idx[local]
                terms = self._micro_step(pb.select(idx), prep, idx,
                                         micro_weight(cfg.loss_aggregation, step_mask, local),
                                         micro_weight("token_mean", step_mask, local))
                for k, v in terms.items():
                    totals[k] = totals.get(k, 0.0) + v
            grad_norm = finite_grad_norm(self.model, cfg.clip_grad, self.weight_version)
            # the critic's too, before either steps: a NaN critic stepped here was committed
            # with the policy, one iteration before the policy's own check failed (review,
            # 2026-11-29)
            critic_norm = finite_grad_norm(self.critic, cfg.clip_grad, self.weight_version,
                                           "critic's gradient") if self.uses_critic else None
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + grad_norm
            self.optimizer.step()
            if critic_norm is not None:
                totals["value_grad_norm"] = totals.get("value_grad_norm", 0.0) + critic_norm
                self.critic_optimizer.step()
            steps += 1
        metrics = {k: v / max(steps, 1) for k, v in totals.items()}
        metrics.update(lr=self.optimizer.param_groups[0]["lr"], optimizer_steps=float(steps))
        return metrics

    def _micro_step(self, mb: PaddedBatch, prep: Prepared, idx: torch.Tensor, weight: float,
                    token_weight: float) -> dict[str, float]:
        """Forward + backward of one micro-batch, its loss scaled by its share of the step;
        returns its metrics times that share (their sum over micro-batches = the step's)."""
        cfg = self.cfg
        mask = prep.mask[idx]
        if cfg.loss_type == "sft":
            logp, _ = self._logprobs(self.model, mb)
            loss, terms = losses.sft_loss(cfg, logp, mask)
        else:
            logp, entropy = self._logprobs(self.model, mb, with_entropy=True,
                                           entropy_grad=cfg.entropy_coef != 0)
            if prep.old_from_grad_pass:
                prep.old_logp[idx] = logp.detach()
            loss, terms = losses.policy_loss(
                cfg, logp, entropy, prep.old_logp[idx], prep.advantages[idx], mask,
                ref_logp=None if prep.ref_logp is None else prep.ref_logp[idx],
                rollout_logp=mb.rollout_logprobs)
        (loss * weight).backward()
        out = {k: float(v) * weight for k, v in terms.items()}
        if self.uses_critic:
            values = self._values(self.critic, mb)
            vloss, vterms = losses.value_loss(cfg, values, prep.old_values[idx],
                                              prep.returns[idx], mask)
            (vloss * token_weight).backward()
            out.update({k: float(v) * token_weight for k, v in vterms.items()})
        return out

    # ---- SFT ----
    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step of  -mean_t log pi(y_t | x, y_<t)  over masked response tokens."""
        pb = pad_batch(batch, self.pad_token_id).to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        with self._compute():
            logp, _ = response_logprobs(self.model, pb, vocab_chunk_size=self.cfg.vocab_chunk_size)
        loss = alg.sft_loss(logp, pb.mask, "token_mean")
        loss.backward()
        grad_norm = finite_grad_norm(self.model, self.cfg.clip_grad, self.weight_version)
        self.optimizer.step()
        return {"sft_loss": float(loss.detach()), "grad_norm": grad_norm}

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # ---- checkpoints ----
    def save(self, checkpoint_dir: str, background: bool = False) -> None:
        """HF checkpoint (+ tokenizer files), trainer_state.pt, and critic.pt (ppo: the critic
        and its optimizer). The state is copied to CPU memory here; ``checkpoint_writer`` writes
        it to a temp folder, fsyncs it and renames it into place (trainers/checkpoint.py), so a
        crash never leaves a half-written version under the final name. ``background``: return
        once the copy is taken, the write overlapping what follows (the next save, or
        ``checkpoint_writer.wait()``, joins it). The reference is not saved: it is re-loaded."""
        files = {STATE_FILE: {"optimizer": self.optimizer.state_dict(),
                              "weight_version": self.weight_version,
                              "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                              "numpy_rng": np.random.get_state()}}
        if self.critic is not None:
            files[CRITIC_FILE] = critic_state(self.critic, self.critic_optimizer)
        snap = Snapshot.take(self.model, files, self._tokenizer_files)
        self.checkpoint_writer.submit(checkpoint_dir, snap, background)

    def load(self, checkpoint_dir: str) -> None:
        self.model = self._load_policy(checkpoint_dir)
        self.model_dir = checkpoint_dir
        self.optimizer = self._make_optimizer(self.cfg.lr)
        state_path = Path(checkpoint_dir) / STATE_FILE
        if state_path.exists():
            # on CPU first: the optimizer moves its state to the parameters' device itself
            state = torch.load(state_path, weights_only=False, map_location="cpu")
            self.optimizer.load_state_dict(state["optimizer"])
            self.weight_version = state["weight_version"]
            torch.set_rng_state(state["torch_rng"])
            random.setstate(state["python_rng"])
            np.random.set_state(state["numpy_rng"])
        critic_path = Path(checkpoint_dir) / CRITIC_FILE
        if critic_path.exists():
            self.critic, self.critic_optimizer = load_critic(
                critic_path, self.model.config, self.cfg.critic_lr or self.cfg.lr,
                self.cfg.weight_decay, self._critic_betas(), device=self.device)
        else:
            self.critic = self.critic_optimizer = None


@dataclass
class Prepared:
    """Per-token tensors [B, T] fixed for one ``train`` call (aligned with the PaddedBatch)."""

    mask: torch.Tensor
    old_logp: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    stats: dict[str, float] = field(default_factory=dict)
    old_from_grad_pass: bool = False  # old_logp is filled by the grad pass itself


def _no_grad_chunks(fn, pb: PaddedBatch, chunk: int) -> torch.Tensor:
    """fn over row chunks of ``pb`` without gradients, concatenated along rows."""
    n = len(pb.mask)
    with torch.no_grad():
        return torch.cat([fn(pb.select(torch.arange(s, min(s + chunk, n),
                                                    device=pb.mask.device)))
                          for s in range(0, n, chunk)])


def _check_rollout_logprobs(batch: TrainBatch) -> None:
    for uid, resp, lps in zip(batch.sample_uids, batch.response_token_ids,
                              batch.rollout_logprobs, strict=True):
        if resp and len(lps or []) < len(resp):
            raise ValueError(f"trainer.use_tis: sample {uid} has {len(lps or [])} rollout "
                             f"log-probs for {len(resp)} response tokens")


def _masked_stats(name: str, x: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """{name}_mean/std/min/max over masked tokens (0 when there are none)."""
    v = x[mask > 0].double()
    if v.numel() == 0:
        return {f"{name}_{s}": 0.0 for s in ("mean", "std", "min", "max")}
    return {f"{name}_mean": float(v.mean()), f"{name}_std": float(v.std()) if v.numel() > 1 else 0.0,
            f"{name}_min": float(v.min()), f"{name}_max": float(v.max())}


def _masked_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """mean over masked tokens of |a - b| (train vs rollout log-prob mismatch)."""
    denom = mask.sum()
    return float(((a - b).abs() * mask).sum() / denom) if denom > 0 else 0.0
