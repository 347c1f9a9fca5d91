"""SFT warm-up task: supervised steps on (prompt, label) pairs of the training split."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.runtime import Runtime
from rollout.rollout import encode_prompt
from trainers.base import TrainBatch


def sft_batch(rt: Runtime, step: int) -> TrainBatch:
    """Batch ``step`` of the seeded data order: responses are the labels followed by EOS."""
    size = rt.cfg.sft.batch_size
    records = [rec for _, rec in rt.dataset.take(step * size, size)]
    tok = rt.tokenizer
    responses = [tok(str(r["label"]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                 for r in records]
    return TrainBatch(
        sample_uids=[f"sft/{step}/{i}" for i in range(size)],
        prompt_token_ids=[encode_prompt(tok, r["prompt"]) for r in records],
        response_token_ids=responses, loss_mask=[[1] * len(x) for x in responses],
        rollout_logprobs=[[] for _ in records], rewards=[0.0] * size, group_keys=[""] * size,
        weight_versions=[0] * size)


@task(name="sft_train", cache_policy=NO_CACHE)
def sft_train(rt: Runtime) -> dict[str, float]:
    cfg = rt.cfg.sft
    rt.trainer.set_lr(cfg.lr)
    metrics: dict[str, float] = {}
    pending: dict[str, float] = {}
    for step in range(cfg.steps):
        metrics = rt.trainer.train_sft(sft_batch(rt, step))
        pending.update({f"sft/{k}": v for k, v in metrics.items()})
        if step % 25 == 0 or step == cfg.steps - 1:
            rt.tracker.log_metrics(pending, step=step)
            rt.report("sft_step", {"step": step + 1, "total": cfg.steps, **metrics})
    rt.trainer.set_lr(rt.cfg.trainer.lr)
    return metrics
