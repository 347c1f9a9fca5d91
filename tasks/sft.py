"""SFT warm-up task: supervised steps on (prompt, label) pairs of the training split.

The warm-up aims at a *middling* starting accuracy so that RL has room to improve: it stops
once greedy accuracy on ``check_size`` training problems reaches ``stop_at_accuracy`` (checked
every ``check_every`` steps). Small models learn arithmetic in a sudden jump, so a fixed step
count lands anywhere between 5% and 90% depending on the seed; the check does not.
"""

from __future__ import annotations

from infra.runtime import Runtime
from rewards.registry import score_samples
from rollout.rollout import encode_prompt, generate_samples, make_samples, render_prompt
from tasks.step import step_task
from tasks.train import in_process_weights
from trainers.base import TrainBatch


def sft_prompt_ids(rt: Runtime, record: dict) -> list[int]:
    """The record's prompt tokens exactly as RL's rollout renders them (chat messages, and
    ``data.apply_chat_template``, through the tokenizer's template): SFT on other text than RL
    generates from trained the wrong prompt, and chat prompts failed outright."""
    text = render_prompt(rt.tokenizer, record["prompt"], rt.cfg.data.apply_chat_template,
                         record.get("tools"))
    return encode_prompt(rt.tokenizer, text)


def sft_batch(rt: Runtime, step: int) -> TrainBatch:
    """Batch ``step`` of the seeded data order: responses are the labels followed by EOS (every
    row has one: ``rollout.data.check_sft_labels`` refused the data at start-up otherwise)."""
    size = rt.cfg.sft.batch_size
    records = [rec for _, rec in rt.dataset.take(step * size, size)]
    tok = rt.tokenizer
    responses = [tok(str(r["label"]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                 for r in records]
    return TrainBatch(
        sample_uids=[f"sft/{step}/{i}" for i in range(size)],
        prompt_token_ids=[sft_prompt_ids(rt, r) for r in records],
        response_token_ids=responses, loss_mask=[[1] * len(x) for x in responses],
        rollout_logprobs=[[] for _ in records], rewards=[0.0] * size, group_keys=[""] * size,
        weight_versions=[0] * size)


def training_accuracy(rt: Runtime) -> float:
    """Greedy accuracy of the trainer's current weights on the first check_size training problems."""
    weights = in_process_weights(rt)
    if weights is not None:
        rt.engine.load_state_dict(weights, rt.engine.weight_version)
    else:  # an out-of-process engine (SGLang), or trainer ranks in other processes
        path = rt.run_dir / "sft_check"
        rt.trainer.save(str(path))
        rt.engine.update_weights(str(path), rt.engine.weight_version)
    prompts = list(enumerate(rt.dataset.records[:rt.cfg.sft.check_size]))
    samples = make_samples(prompts, rt.tokenizer, 1, rt.dataset.source,
                           apply_chat_template=rt.cfg.data.apply_chat_template)
    generate_samples(rt.engine, rt.tokenizer, samples, rt.sampling(greedy=True))
    score_samples(samples, rt.reward_fn)
    return sum(s.reward == 1.0 for s in samples) / len(samples)


@step_task(name="sft_train")
def sft_train(rt: Runtime) -> dict[str, float]:
    cfg = rt.cfg.sft
    rt.trainer.set_lr(cfg.lr)
    metrics: dict[str, float] = {}
    for step in range(cfg.steps):
        metrics = {f"sft/{k}": v for k, v in rt.trainer.train_sft(sft_batch(rt, step)).items()}
        if cfg.stop_at_accuracy is not None and (step + 1) % cfg.check_every == 0:
            metrics["sft/train_accuracy"] = training_accuracy(rt)
        if step % cfg.check_every == 0 or "sft/train_accuracy" in metrics:
            rt.tracker.log_metrics(metrics, step=step)
            rt.report("sft_step", {"step": step + 1, "total": cfg.steps, **metrics})
        if metrics.get("sft/train_accuracy", 0.0) >= (cfg.stop_at_accuracy or 2.0):
            break
    rt.trainer.set_lr(rt.cfg.trainer.lr)
    return {**metrics, "sft/steps": float(step + 1)}
