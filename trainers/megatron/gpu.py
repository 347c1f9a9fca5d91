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

from trainers.losses import micro_weight
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


def _micro_batches(trainer: Any, start: int, step: int, micro: int) -> list[Tensor]:
    """This DP rank's micro-batch index tensors of the step starting at ``start``."""
    return list(trainer._dp_slice(torch.arange(start, start + step)).split(micro))


def _run_schedule(trainer: Any, model: Any, pb: Any, micro_batches: list[Tensor],
                  loss_func: Callable[[Tensor, Tensor], tuple[Tensor, dict[str, Any]]],
                  forward_only: bool) -> list[dict[str, Any]]:
    """megatron's forward/backward schedule (1F1B over PP stages, or no pipelining) over
    ``micro_batches``: each forward_step runs the (stage of the) model on the micro-batch's
    right-padded tokens; on the last stage ``loss_func(idx, logits)`` gives (loss, data).
    Returns the per-micro-batch data (last stage only; empty elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from trainers.megatron.model import forward_logits

    def forward_step(data_iterator, stage_model):
        idx = next(data_iterator)
        return forward_logits(stage_model, pb.input_ids[idx]), partial(loss_func, idx)

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
        num_microbatches=len(micro_batches), seq_length=pb.input_ids.shape[1],
        micro_batch_size=len(micro_batches[0]), forward_only=forward_only)


def forward_only_logprobs(trainer: Any, model: Any, pb: Any) -> Tensor:
    """[B, T] response log-probs without gradients, micro-batch by micro-batch through the
    schedule; with PP only the last stage has them (zeros elsewhere)."""
    from megatron.core import parallel_state as ps

    n = pb.input_ids.shape[0]
    micro = min(int(trainer.cfg.micro_batch_size), n)
    chunks = list(torch.arange(n).split(micro))
    out = torch.zeros(pb.response_ids.shape, device=pb.response_ids.device)

    def collect(idx: Tensor, logits: Tensor) -> tuple[Tensor, dict[str, Any]]:
        logp, _ = trainer.logprobs_from_logits(logits, pb.select(idx))
        return logp.sum() * 0.0, {"idx": idx, "logp": logp}

    # Variable-size last micro-batch: run the schedule per equal-size group of micro-batches.
    for group in _equal_size_groups(chunks):
        with torch.no_grad():
            results = _run_schedule(trainer, model, pb, group, collect, forward_only=True)
        if ps.is_pipeline_last_stage():
            for r in results:
                out[r["idx"]] = r["logp"].float()
    return out


def step_spans(n: int, step: int) -> list[tuple[int, int]]:
    """(start, size) of each optimizer step over ``n`` samples taken ``step`` at a time:
    ceil(n / step) steps, the last one holding the n mod step trailing samples (as the torch
    trainer does; none are dropped)."""
    return [(start, min(step, n - start)) for start in range(0, n, step)]


def _equal_size_groups(chunks: list[Tensor]) -> list[list[Tensor]]:
    """Consecutive chunks of equal length grouped together (a schedule call needs equal-size
    micro-batches; only the last chunk of a split can be shorter)."""
    groups: list[list[Tensor]] = []
    for c in chunks:
        if groups and len(groups[-1][0]) == len(c):
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


def check_step_sizes(step: int, sizes: list[int], dp: int, micro: int) -> None:
    """Every optimizer step must split into equal micro-batches on every DP rank: each step
    size a multiple of dp * micro_batch_size (the last step holds the trailing samples)."""
    if step % (dp * micro):
        raise ValueError(f"trainer.global_batch_size={step} must be a multiple of data parallel "
                         f"size {dp} * micro_batch_size {micro} on GPU")
    if sizes and sizes[-1] % (dp * micro):
        raise ValueError(f"a batch of {sum(sizes)} samples leaves a last optimizer step of "
                         f"{sizes[-1]} (trainer.global_batch_size={step}), not a multiple of data "
                         f"parallel size {dp} * micro_batch_size {micro} on GPU: make the training "
                         "batch a multiple of it")


def _share_weighted(loss_from_logits: Callable[[Tensor, Tensor], tuple[Tensor, dict[str, float]]],
                    agg: str, step_mask: Tensor, start: int, n_micro: int, dp: int
                    ) -> Callable[[Tensor, Tensor], tuple[Tensor, dict[str, float]]]:
    """``loss_from_logits`` with micro-batch m's loss scaled so that the step's gradient is
    sum_m w_m grad L_m, w_m = ``micro_weight(agg, step_mask, m)`` (its share of the step's
    samples or tokens, over all DP ranks): the schedule divides each loss by the number of
    micro-batches M and DDP averages over the dp ranks, so the loss given to them is
    L_m * w_m * M * dp. Its metrics come back times w_m (their sum over the step is the
    step's)."""
    def weighted(idx: Tensor, logits: Tensor) -> tuple[Tensor, dict[str, float]]:
        loss, terms = loss_from_logits(idx, logits)
        w = micro_weight(agg, step_mask, idx - start)
        return loss * (w * n_micro * dp), {k: float(v) * w for k, v in terms.items()}
    return weighted


def optimize(trainer: Any, pb: Any, step: int, micro: int,
             loss_from_logits: Callable[[Tensor, Tensor], tuple[Tensor, dict[str, float]]],
             agg: str = "sample_mean") -> dict[str, float]:
    """Optimizer steps with megatron's schedule, DDP and optimizer. Each step's samples are
    split over DP ranks and into micro-batches of ``micro``, which the schedule needs
    equal-sized: ``global_batch_size`` must be a multiple of ``dp * micro_batch_size``. Each
    micro-batch loss carries its share of the step's samples (sample_mean) or tokens
    (token_mean), ``_share_weighted``. Metrics are the last stage's, weighted the same way,
    summed over micro-batches and DP ranks, averaged over steps."""
    from megatron.core import parallel_state as ps

    n = pb.input_ids.shape[0]
    spans = step_spans(n, step)
    check_step_sizes(step, [size for _, size in spans], trainer.dp, micro)
    totals: dict[str, float] = {}
    steps = 0
    for start, size in spans:
        trainer.model.zero_grad_buffer()
        trainer.optimizer.zero_grad()
        micro_batches = _micro_batches(trainer, start, size, micro)
        weighted = _share_weighted(loss_from_logits, agg, pb.mask[start:start + size], start,
                                   len(micro_batches), trainer.dp)
        results = _run_schedule(trainer, trainer.model, pb, micro_batches, weighted,
                                forward_only=False)
        ok, grad_norm, _ = trainer.optimizer.step()
        if not ok:
            raise FloatingPointError("megatron optimizer step skipped (inf/nan gradients)")
        for r in results:
            for k, v in r.items():
                totals[k] = totals.get(k, 0.0) + float(v)  # already times its share
        totals["grad_norm"] = totals.get("grad_norm", 0.0) + float(grad_norm or 0.0)
        steps += 1
    if trainer.dp > 1:
        keys = sorted(k for k in totals if k != "grad_norm")
        vals = torch.tensor([totals.get(k, 0.0) for k in keys], dtype=torch.float64,
                            device="cuda")
        torch.distributed.all_reduce(vals, group=ps.get_data_parallel_group())
        totals.update(zip(keys, vals.tolist(), strict=True))  # shares of the whole step
    out = {k: v / max(steps, 1) for k, v in totals.items()}
    out["optimizer_steps"] = float(steps)
    return out
