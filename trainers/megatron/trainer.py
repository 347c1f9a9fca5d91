"""``MegatronTrainer``: the Trainer interface on a megatron-core GPTModel (``trainer.backend:
megatron``).

One process is one rank (TP x PP x DP = world size; ``launch.py`` spawns the ranks). A run starts
from an HF checkpoint (mapped and sharded by ``weight_mapping``) and every ``save`` writes an HF
checkpoint again (rank 0 gathers the shards), plus each rank's optimizer/RNG state.

On CPU: the two ``cpu_patches``, torch AdamW on this rank's parameter shards, gradients summed
over the data-parallel group by hand, a TP-aware grad-norm clip. On GPU: megatron's
DistributedDataParallel, its optimizer and its forward/backward schedule (``gpu.py``).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainers import algorithms as alg
from trainers.base import PaddedBatch, TrainBatch, pad_batch
from trainers.checkpoint import CHAT_TEMPLATE_DIR
from trainers.losses import micro_weight
from trainers.megatron import losses
from trainers.megatron.gpu import step_spans
from trainers.megatron.losses import cfg_get
from trainers.megatron.model import (
    build_gpt_model,
    forward_logits,
    init_distributed,
    mask_padded_vocab,
    vocab_parallel_entropy,
    vocab_parallel_log_probs,
)
from trainers.megatron.weight_mapping import ModelShape, hf_to_megatron, megatron_to_hf
from trainers.reference import needs_reference

STATE_DIR = "megatron_state"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def read_hf_weights(model_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint folder (``*.safetensors``, else ``pytorch_model*.bin``)."""
    folder = Path(model_dir)
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors or pytorch_model*.bin weights")
    out = {}
    for f in bins:
        out.update(torch.load(f, map_location="cpu", weights_only=True))
    return out


def write_hf_checkpoint(hf_state: dict[str, torch.Tensor], source_dir: str, out_dir: Path) -> None:
    """``model.safetensors`` + every non-weight file of ``source_dir`` (config, generation
    config, tokenizer files) into ``out_dir``: a folder HF ``from_pretrained`` loads."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for f in Path(source_dir).iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.name != \
                "model.safetensors.index.json":
            shutil.copy(f, out_dir / f.name)
    if (templates := Path(source_dir) / CHAT_TEMPLATE_DIR).is_dir():  # named chat templates
        shutil.copytree(templates, out_dir / CHAT_TEMPLATE_DIR, dirs_exist_ok=True)
    # copy=True: hf_state may hold views of live (or one shared) storage; safetensors wants
    # each tensor in memory of its own
    save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in hf_state.items()},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def clip_grad_norm_tp(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global grad norm over TP shards, then clip: ||g|| = sqrt(all_reduce_tp(sum_sharded g^2)
    + sum_replicated g^2); g *= min(1, max_norm / (||g|| + 1e-6)) (torch's clip rule)."""
    from megatron.core import parallel_state as ps

    grads_tp = [p.grad for p in params if p.grad is not None
                and getattr(p, "tensor_model_parallel", False)]
    grads_rep = [p.grad for p in params if p.grad is not None
                 and not getattr(p, "tensor_model_parallel", False)]
    device = next((p.device for p in params), torch.device("cpu"))

    def sq(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()

    sq_tp, sq_rep = sq(grads_tp), sq(grads_rep)
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(sq_tp, group=ps.get_tensor_model_parallel_group())
    total = float((sq_tp + sq_rep).sqrt())
    coef = max_norm / (total + 1e-6)
    if coef < 1.0 and grads_tp + grads_rep:
        torch._foreach_mul_(grads_tp + grads_rep, coef)
    return total


class MegatronTrainer:
    """Policy on megatron-core (+ a frozen reference when KL is used: ``use_kl_loss``, or
    ``kl_coef > 0`` with reinforce_plus_plus*).

    ``config``: any object with the trainer attributes (lr, eps_clip, eps_clip_high, eps_clip_c,
    advantage_estimator, use_kl_loss, kl_loss_coef, kl_loss_type, entropy_coef,
    global_batch_size, micro_batch_size, clip_grad, weight_decay, adam_beta1, adam_beta2,
    loss_aggregation, tensor_model_parallel_size, pipeline_model_parallel_size, ...).
    ``n_samples_per_prompt`` / ``rollout_temperature`` default to the config's attributes.
    ``reference_dir``: the HF folder of the KL reference, as the torch trainer's (the runtime
    passes checkpoint v0; default ``model_dir``); ``ref_load`` overrides it.
    """

    def __init__(self, config: Any, model_dir: str, n_samples_per_prompt: int | None = None,
                 rollout_temperature: float | None = None, weight_version: int = 0,
                 pad_token_id: int = 0, seed: int = 1234, dtype: str | None = None,
                 reference_dir: str | None = None) -> None:
        from megatron.core import parallel_state as ps

        self.cfg = config
        self.model_dir = model_dir
        self.reference_dir = cfg_get(config, "ref_load", None) or reference_dir or model_dir
        self.n_samples_per_prompt = int(n_samples_per_prompt or cfg_get(
            config, "n_samples_per_prompt", 1))
        self.temperature = float(rollout_temperature or cfg_get(config, "rollout_temperature",
                                                                1.0))
        self.pad_token_id = pad_token_id
        self.weight_version = weight_version
        self.tp = int(cfg_get(config, "tensor_model_parallel_size", 1))
        self.pp = int(cfg_get(config, "pipeline_model_parallel_size", 1))
        self.on_gpu = torch.cuda.is_available()
        if self.pp > 1 and not self.on_gpu:
            raise ValueError(f"trainer.pipeline_model_parallel_size={self.pp}: pipeline "
                             "parallelism needs megatron's schedules, which need GPUs")
        init_distributed(self.tp, self.pp, seed)
        self._patches = None
        if not self.on_gpu:
            from trainers.megatron.cpu_patches import apply_cpu_patches
            self._patches = apply_cpu_patches(seed)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp = ps.get_data_parallel_world_size()
        from transformers import AutoConfig
        self.hf_config = AutoConfig.from_pretrained(model_dir)
        self.shape = ModelShape.from_hf_config(self.hf_config)
        # dtype: the run's resolved dtype (fp32|bf16); None keeps the config's legacy ``bf16``
        bf16 = dtype == "bf16" if dtype is not None else bool(cfg_get(config, "bf16", False))
        self.dtype = torch.bfloat16 if self.on_gpu and bf16 else torch.float32
        self.model = build_gpt_model(self.shape, self.tp, self.pp, self.dtype)
        self._load_weights(self.model, model_dir)
        self.ref_model: torch.nn.Module | None = None  # loaded at the first train (reference())
        self._make_optimizer()

    # ---- the reference (KL) ----
    @property
    def uses_reference(self) -> bool:
        """KL in the loss, or in the reward (kl_coef > 0 with reinforce_plus_plus*); the
        runtime keeps checkpoint v0 while this is true (``Runtime.trainer_needs_v0``)."""
        return needs_reference(bool(cfg_get(self.cfg, "use_kl_loss", False)),
                               float(cfg_get(self.cfg, "kl_coef", 0.0)),
                               cfg_get(self.cfg, "advantage_estimator", "grpo"))

    def reference(self) -> torch.nn.Module:
        """The frozen reference from ``reference_dir``, built on first use: at construction
        on a fresh run, checkpoint v0 (the SFT warm-up's output) does not exist yet."""
        if self.ref_model is None:
            # building draws random initial weights (overwritten by the load): leave the RNG
            # stream the run saves in its checkpoints as if it had not been built
            devices = [torch.cuda.current_device()] if self.on_gpu else []
            with torch.random.fork_rng(devices=devices):
                model = build_gpt_model(self.shape, self.tp, self.pp, self.dtype).eval()
            self._load_weights(model, self.reference_dir)
            self.ref_model = model.requires_grad_(False)
        return self.ref_model

    # ---- weights ----
    def _load_weights(self, model: torch.nn.Module, model_dir: str) -> None:
        sd = hf_to_megatron(read_hf_weights(model_dir), self.shape, self.tp_rank, self.tp,
                            self.pp_rank, self.pp)
        target = getattr(model, "module", model)
        missing, unexpected = target.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"{model_dir}: megatron weights missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")

    def _make_optimizer(self) -> None:
        cfg = self.cfg
        if self.on_gpu:  # UNTESTED here (no GPU): megatron DDP + optimizer
            from trainers.megatron import gpu
            self.model, self.optimizer = gpu.wrap_model_and_optimizer(
                self.model, self.model.config, cfg)
            return
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg_get(cfg, "weight_decay", 0.0),
            betas=(cfg_get(cfg, "adam_beta1", 0.9), cfg_get(cfg, "adam_beta2", 0.99)))

    def local_state_dict(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """This rank's megatron weights (no ``_extra_state``): detached CPU copies, or with
        ``copy=False`` detached views where they live (the GPU)."""
        target = getattr(self.model, "module", self.model)
        return {k: v.detach().to("cpu").clone() if copy else v.detach()
                for k, v in target.state_dict().items()
                if not k.endswith("_extra_state") and isinstance(v, torch.Tensor)}

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full HF state dict, gathered from every TP/PP shard onto global rank 0
        (None on other ranks), on this rank's device. Collective: every rank must call it.
        Only names/shapes travel as objects; each shard's tensors travel as one flat byte
        tensor per rank (``weight_transfer.pack``: send/recv, NCCL on GPU), not pickled."""
        from trainers.weight_transfer import TensorMeta, pack, packed_size, unpack

        local = self.local_state_dict(copy=False)
        metas = [TensorMeta(k, tuple(v.shape), str(v.dtype).removeprefix("torch."))
                 for k, v in local.items()]
        mine = (self.pp_rank, self.tp_rank, self.dp_rank, [(m.name, m.shape, m.dtype)
                                                           for m in metas])
        rank = dist.get_rank()
        heads: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, heads, dst=0)
        if rank != 0:
            if self.dp_rank == 0:
                dist.send(pack(list(local.values()), self._device), dst=0)
            return None
        shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for src, (pp_rank, tp_rank, dp_rank, entries) in enumerate(heads):
            if dp_rank != 0:
                continue
            if src == 0:
                shards[(pp_rank, tp_rank)] = local
                continue
            theirs = [TensorMeta(n, tuple(s), d) for n, s, d in entries]
            flat = torch.empty(packed_size(theirs), dtype=torch.uint8,
                               device=self._device)
            dist.recv(flat, src=src)
            shards[(pp_rank, tp_rank)] = unpack(flat, theirs)
        out: dict[str, torch.Tensor] = {}
        for pp_rank in range(self.pp):
            out.update(megatron_to_hf([shards[(pp_rank, t)] for t in range(self.tp)],
                                      self.shape, pp_rank, self.pp))
        return out

    # ---- log-probs ----
    def logprobs_from_logits(self, logits: torch.Tensor, pb: PaddedBatch,
                             with_entropy: bool = False) -> tuple[torch.Tensor,
                                                                   torch.Tensor | None]:
        """log pi(y_t | x, y_<t) at temperature T from vocab-parallel logits [B, S, V/tp]:
        megatron's vocab-parallel cross entropy on logits / T gathered at the response
        positions (padded vocab ids masked); entropy likewise vocab-parallel.
        Returns ([B, T], [B, T] or None)."""
        idx = pb.response_index[..., None].expand(-1, -1, logits.shape[-1])
        z = logits.gather(1, idx).float() / self.temperature
        z = mask_padded_vocab(z, self.shape.vocab_size)
        logp = vocab_parallel_log_probs(z, pb.response_ids)
        return logp, (vocab_parallel_entropy(z) if with_entropy else None)

    @torch.no_grad()
    def _logprobs_no_grad(self, model: torch.nn.Module, pb: PaddedBatch) -> torch.Tensor:
        """[B, T] log-probs of ``model`` without gradients (on GPU via megatron's schedule in
        forward-only mode; with PP the values live on the last stage, zeros elsewhere)."""
        if self.on_gpu:  # UNTESTED here (no GPU)
            from trainers.megatron import gpu
            return gpu.forward_only_logprobs(self, model, pb)
        return self.logprobs_from_logits(forward_logits(model, pb.input_ids), pb)[0]

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, T] response log-probs of the current policy (right-padded, 0 past the end)."""
        pb = pad_batch(batch, self.pad_token_id).to(self._device)
        logp = (self._logprobs_no_grad(self.model, pb) * pb.mask).cpu()
        return self._from_last_stage(logp)

    def _from_last_stage(self, obj: Any) -> Any:
        """``obj`` as the last pipeline stage has it, on every stage (identity without PP)."""
        if self.pp == 1:
            return obj
        from megatron.core import parallel_state as ps
        box = [obj]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return box[0]

    @property
    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.on_gpu \
            else torch.device("cpu")

    def _step_plan(self, n: int, one_step: bool = False) -> tuple[int, int]:
        """(samples per optimizer step, per micro-batch): ``global_batch_size`` per step, or
        the whole batch in one step (``one_step``: SFT); ``micro_batch_size`` either way."""
        step = n if one_step else min(int(self.cfg.global_batch_size), n)
        micro = min(int(self.cfg.micro_batch_size), step)
        return step, micro

    def _dp_slice(self, idx: torch.Tensor) -> torch.Tensor:
        """This DP rank's contiguous part of a step's sample indices."""
        return idx.tensor_split(self.dp)[self.dp_rank]

    # ---- RL ----
    def train(self, batch: TrainBatch) -> dict[str, float]:
        """Old log-probs, advantages, then ceil(B / global_batch_size) optimizer steps (the
        torch trainer's schedule); metrics averaged over steps."""
        cfg = self.cfg
        batch.check_groups(self.n_samples_per_prompt)  # advantages read n consecutive rows
        pb = pad_batch(batch, self.pad_token_id).to(self._device)
        rewards = torch.tensor(batch.rewards, dtype=torch.float32, device=self._device)
        old_logp = self._logprobs_no_grad(self.model, pb)
        ref_logp = self._logprobs_no_grad(self.reference(), pb) if self.uses_reference else None
        kl = self._reward_kl(old_logp, ref_logp)
        advantages = losses.compute_advantages(cfg, rewards, pb.mask, self.n_samples_per_prompt,
                                               kl)

        def loss_from_logits(idx: torch.Tensor, logits: torch.Tensor
                             ) -> tuple[torch.Tensor, dict[str, float]]:
            sub = pb.select(idx)
            logp, entropy = self.logprobs_from_logits(logits, sub, with_entropy=True)
            return losses.actor_loss(cfg, logp, entropy, old_logp[idx], advantages[idx],
                                     sub.mask, None if ref_logp is None else ref_logp[idx],
                                     sub.rollout_logprobs)

        metrics = self._optimize(pb, loss_from_logits,
                                 cfg_get(cfg, "loss_aggregation", "sample_mean"))
        self.weight_version += 1
        if kl is not None:
            metrics["reward_kl"] = float(alg.masked_mean(kl, pb.mask))
        masked_adv = advantages[pb.mask > 0]
        metrics.update(
            lr=float(cfg.lr),
            advantage_mean=float(masked_adv.mean()) if masked_adv.numel() else 0.0,
            advantage_std=float(masked_adv.std()) if masked_adv.numel() > 1 else 0.0,
            train_rollout_logprob_abs_diff=losses.masked_abs_diff(old_logp, pb.rollout_logprobs,
                                                                  pb.mask))
        return self._from_last_stage(metrics)

    def _reward_kl(self, old_logp: torch.Tensor, ref_logp: torch.Tensor | None
                   ) -> torch.Tensor | None:
        """KL in the reward, as the torch trainer: kl = compute_approx_kl(lp_old, lp_ref,
        kl_loss_type) when kl_coef > 0 and the estimator uses it (ref_logp given), else None."""
        if ref_logp is None or float(cfg_get(self.cfg, "kl_coef", 0.0)) <= 0:
            return None
        return alg.compute_approx_kl(old_logp, ref_logp,
                                     cfg_get(self.cfg, "kl_loss_type", "low_var_kl"))

    def _optimize(self, pb: PaddedBatch, loss_from_logits, agg: str,
                  one_step: bool = False) -> dict[str, float]:
        """Optimizer steps over the batch (``global_batch_size`` samples each, or one step of the
        whole batch with ``one_step``); ``loss_from_logits(idx, logits)`` -> (loss, metrics)
        of micro-batch ``idx``, aggregated by ``agg`` (sample_mean | token_mean). Each
        micro-batch loss is weighted by its share of the step (``trainers.losses.micro_weight``:
        samples for sample_mean, tokens for token_mean), so the step's gradient is that of the
        whole step's loss (summed over DP ranks), whatever micro_batch_size is."""
        n = pb.input_ids.shape[0]
        step, micro = self._step_plan(n, one_step)
        if self.on_gpu:  # UNTESTED here (no GPU)
            from trainers.megatron import gpu
            return gpu.optimize(self, pb, step, micro, loss_from_logits, agg)
        from megatron.core import parallel_state as ps
        totals: dict[str, float] = {}
        steps = 0
        params = [p for p in self.model.parameters() if p.requires_grad]
        for start, size in step_spans(n, step):
            self.optimizer.zero_grad(set_to_none=False)
            mine = self._dp_slice(torch.arange(start, start + size))
            step_mask = pb.mask[start:start + size]  # the whole step's, every DP rank's rows
            for m0 in range(0, len(mine), micro):
                idx = mine[m0:m0 + micro]
                loss, terms = loss_from_logits(idx, forward_logits(self.model,
                                                                   pb.input_ids[idx]))
                weight = micro_weight(agg, step_mask, idx - start)
                (loss * weight).backward()
                for k, v in terms.items():
                    totals[k] = totals.get(k, 0.0) + v * weight
            if self.dp > 1:
                for p in params:
                    dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + clip_grad_norm_tp(
                params, float(self.cfg.clip_grad))
            self.optimizer.step()
            steps += 1
        if self.dp > 1:  # metric sums over DP ranks (grad_norm is already global)
            keys = sorted(k for k in totals if k != "grad_norm")
            vals = torch.tensor([totals[k] for k in keys], dtype=torch.float64)
            dist.all_reduce(vals, group=ps.get_data_parallel_group())
            totals.update(zip(keys, vals.tolist(), strict=True))
        out = {k: v / max(steps, 1) for k, v in totals.items()}
        out["optimizer_steps"] = float(steps)
        return out

    # ---- SFT ----
    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step of  -mean_t log pi(y_t | x, y_<t)  over masked response tokens
        (temperature 1, aggregation ``token_mean`` over the batch's tokens), as the torch
        trainer's: the SFT batch is one step whatever ``global_batch_size`` (the RL step size)
        is, still run as micro-batches of ``micro_batch_size``."""
        pb = pad_batch(batch, self.pad_token_id).to(self._device)
        saved_t, self.temperature = self.temperature, 1.0
        try:
            def loss_from_logits(idx: torch.Tensor, logits: torch.Tensor
                                 ) -> tuple[torch.Tensor, dict[str, float]]:
                sub = pb.select(idx)
                logp, _ = self.logprobs_from_logits(logits, sub)
                loss = alg.sft_loss(logp, sub.mask, "token_mean")
                return loss, {"sft_loss": float(loss.detach())}
            return self._from_last_stage(self._optimize(pb, loss_from_logits, "token_mean",
                                                        one_step=True))
        finally:
            self.temperature = saved_t

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # ---- checkpoints ----
    def save(self, checkpoint_dir: str) -> None:
        """HF checkpoint (rank 0) + ``megatron_state/rank{r}.pt`` per rank, written into a temp
        folder renamed into place after every rank is done. Collective."""
        final = Path(checkpoint_dir)
        tmp = final.with_name(final.name + ".tmp")
        hf = self.hf_state_dict()
        rank = dist.get_rank()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            write_hf_checkpoint(hf, self.model_dir, tmp)
            (tmp / STATE_DIR).mkdir()
            (tmp / STATE_DIR / "layout.json").write_text(json.dumps(self._layout()))
        dist.barrier()
        torch.save({"optimizer": self.optimizer.state_dict(),
                    "weight_version": self.weight_version,
                    "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()},
                   tmp / STATE_DIR / f"rank{rank}.pt")
        dist.barrier()
        if rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        dist.barrier()

    def _layout(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "world": dist.get_world_size()}

    def load(self, checkpoint_dir: str) -> None:
        """Weights from the HF checkpoint (any layout); optimizer/RNG/version from this rank's
        state file when the parallel layout matches (else a fresh optimizer)."""
        self._load_weights(self.model, checkpoint_dir)
        if self.on_gpu and hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()
        else:
            self._make_optimizer()
        self.model_dir = checkpoint_dir
        state_dir = Path(checkpoint_dir) / STATE_DIR
        layout = state_dir / "layout.json"
        if layout.exists() and json.loads(layout.read_text()) == self._layout():
            state = torch.load(state_dir / f"rank{dist.get_rank()}.pt", weights_only=False)
            self.optimizer.load_state_dict(state["optimizer"])
            self.weight_version = state["weight_version"]
            torch.set_rng_state(state["torch_rng"])
            random.setstate(state["python_rng"])

    def close(self) -> None:
        """Undo the CPU patches (the process groups stay: megatron keeps them global)."""
        if self._patches is not None:
            self._patches.undo()
            self._patches = None
