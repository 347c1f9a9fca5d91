"""The GPU path of the megatron backend: megatron's DistributedDataParallel, its optimizer
(Adam with decoupled weight decay, grad clipping, bf16 master weights) and its forward/backward
schedule (``get_forward_backward_func``: no-pipelining or 1F1B over PP stages).

UNTESTED on the machines this project is developed on (CPU only); written against
megatron-core 0.16.1's API. The CPU path in ``trainer.py`` computes the same loss.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from trainers.megatron.losses import cfg_get

Tensor = torch.Tensor


def wrap_model_and_optimizer(model: torch.nn.Module, tf_config: Any, cfg: Any):
    """(DDP-wrapped model, megatron optimizer) for ``model`` already on the GPU; ``tf_config``
    must be the model's own ``TransformerConfig`` (the schedule reads hooks from it)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(
        config=tf_config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                 overlap_grad_reduce=False,
                                                 use_distributed_optimizer=False),
        module=model)
    opt_cfg = OptimizerConfig(
        optimizer="adam", lr=float(cfg.lr), weight_decay=cfg_get(cfg, "weight_decay", 0.0),
        adam_beta1=cfg_get(cfg, "adam_beta1", 0.9), adam_beta2=cfg_get(cfg, "adam_beta2", 0.99),
        clip_grad=float(cfg_get(cfg, "clip_grad", 1.0)), bf16=tf_config.bf16,
        fp16=tf_config.fp16, params_dtype=tf_config.params_dtype)
    optimizer = get_megatron_optimizer(opt_cfg, [ddp])
    # What megatron's training loop wires into the model config before using its schedules:
    # loss scaling (fp16), no-sync during accumulation, and the DP gradient all-reduce at the end.
    from megatron.core.distributed import finalize_model_grads
    tf_config.grad_scale_func = optimizer.scale_loss
    tf_config.no_sync_func = ddp.no_sync
    tf_config.finalize_model_grads_func = finalize_model_grads
    return ddp, optimizer


def optimize(trainer: Any, n: int, step: int, micro: int,
             loss_fn: Callable[[Tensor], tuple[Tensor, dict[str, float]]]) -> dict[str, float]:
    """Optimizer steps with megatron's schedule. Each step's samples are split over DP ranks
    and into micro-batches of ``micro``; the schedule divides each micro-batch loss by the
    number of micro-batches and DDP averages over DP, so micro-batches must be equal-sized:
    ``global_batch_size`` must be a multiple of ``dp * micro_batch_size``."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if step % (trainer.dp * micro):
        raise ValueError(f"trainer.global_batch_size={step} must be a multiple of data parallel "
                         f"size {trainer.dp} * micro_batch_size {micro} on GPU")
    fwd_bwd = get_forward_backward_func()
    totals: dict[str, float] = {}
    steps = 0
    for start in range(0, n - step + 1, step):
        mine = trainer._dp_slice(torch.arange(start, start + step))
        micro_batches = list(mine.split(micro))
        trainer.model.zero_grad_buffer()
        trainer.optimizer.zero_grad()

        def forward_step(data_iterator, model, _lf=loss_fn):
            idx = next(data_iterator)
            # The loss function of the last stage recomputes from the model output; with PP=1
            # the whole micro-batch loss comes from ``loss_fn`` (which runs the model itself),
            # so the "output" is the loss and the schedule's loss_func passes it through.
            loss, terms = _lf(idx)
            return loss, partial(_pass_through, terms)

        if trainer.pp > 1:
            raise NotImplementedError(
                "pipeline_model_parallel_size > 1: a stage-aware forward_step (hidden states "
                "between stages, logits on the last stage) is not written yet")
        results = fwd_bwd(forward_step_func=forward_step, data_iterator=iter(micro_batches),
                          model=[trainer.model], num_microbatches=len(micro_batches),
                          seq_length=0, micro_batch_size=micro, forward_only=False)
        ok, grad_norm, _ = trainer.optimizer.step()
        if not ok:
            raise FloatingPointError("megatron optimizer step skipped (inf/nan gradients)")
        for r in results:
            for k, v in r.items():
                totals[k] = totals.get(k, 0.0) + float(v) / len(results)
        totals["grad_norm"] = totals.get("grad_norm", 0.0) + float(grad_norm or 0.0)
        steps += 1
    if trainer.dp > 1:
        keys = sorted(k for k in totals if k != "grad_norm")
        vals = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device="cuda")
        torch.distributed.all_reduce(vals, group=ps.get_data_parallel_group())
        totals.update(zip(keys, (vals / trainer.dp).tolist(), strict=True))
    out = {k: v / max(steps, 1) for k, v in totals.items()}
    out["optimizer_steps"] = float(steps)
    return out


def _pass_through(terms: dict[str, float], output: Tensor) -> tuple[Tensor, dict[str, float]]:
    """megatron loss_func contract (2-tuple form): (loss to backprop, reduced metrics)."""
    return output, terms
