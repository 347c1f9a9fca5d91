"""Re-training a committed step from the lake (a resume between checkpoints): no generation.

A ``train_steps`` row names the exact samples its step trained on (``sample_uids``); the lake
still holds them (trajectories are append-only), so the step can be done again. With
``deterministic: true`` and the same seeds it ends in the same weights and optimizer state, bit
for bit: the lake is the write-ahead log, a checkpoint only a shortcut (infra/checkpoints.py).
"""

from __future__ import annotations

from infra.runtime import Runtime, iteration_seed
from tasks.step import step_task
from trainers.base import TrainBatch
from trainers.torch_trainer import seed_everything

# the loss terms a train_steps row records (flows/steps.py); a re-trained step must reproduce them
RECORDED_TERMS = ("pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss", "grad_norm")


def seed_training(rt: Runtime, iteration: int) -> int:
    """Seed the global RNGs for iteration ``iteration``'s training whatever ran before it in the
    process (generation, or nothing on a rebuild):  s = iteration_seed(seed, iteration) XOR 2**62.
    Returns s."""
    s = iteration_seed(rt.cfg.seed, iteration) ^ (1 << 62)
    seed_everything(s)
    return s


@step_task(name="retrain_step")
def retrain_step(rt: Runtime, step: dict, run_id: str | None = None) -> bool:
    """Train again on the samples committed step ``step`` (a train_steps row of ``run_id``,
    default this run) consumed, read from the lake in the recorded order. Returns whether the
    loss terms equal the recorded ones."""
    uids, run_id = step["sample_uids"], run_id or rt.run_id
    # no version bound: a replay run's rows carry the source's versions, not the replay's
    table = rt.lake.read_samples(run_id, uids)
    if table.num_rows != len(uids):
        raise ValueError(f"run {run_id}: iteration {step['iteration']} trained on {len(uids)} "
                         f"samples, the lake holds {table.num_rows} of them: cannot rebuild "
                         f"weight version {step['weight_version']}")
    seed_training(rt, step["iteration"])
    metrics = rt.trainer.train(TrainBatch.from_arrow(table))
    if rt.trainer.weight_version != step["weight_version"]:
        raise RuntimeError(f"rebuild of iteration {step['iteration']}: trainer at version "
                           f"{rt.trainer.weight_version}, the lake says {step['weight_version']}")
    return all(step.get(k) is None or metrics.get(k) == step[k] for k in RECORDED_TERMS)
