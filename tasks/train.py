"""Training tasks: train on a slice, publish the new weight version.

MLflow metrics are no task: ``Tracker.log_metrics`` only queues them for its background sender
(which retries), so a task run around it was Prefect's per-task cost for a queue put."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from infra.faults import fault_point
from infra.runtime import Runtime
from tasks.step import step_task
from trainers.base import TrainBatch


@step_task(name="train")
def train(rt: Runtime, training_slice: pa.Table) -> dict[str, float]:
    if training_slice.num_rows == 0:
        raise RuntimeError(f"run {rt.run_id}: the training slice is empty "
                           f"(weight_version {rt.trainer.weight_version})")
    return rt.trainer.train(TrainBatch.from_arrow(training_slice))


@step_task(name="publish_weights")
def publish_weights(rt: Runtime, weight_version: int, save: bool = True, wait: bool = True,
                    prune: bool = True, to_engine: bool = True) -> str | None:
    """Hand weights ``v`` to the engine: in memory where it takes tensors (an in-process engine
    copies them; SGLang with ``weight_sync: distributed`` receives them over its weight-update
    group), else from checkpoint ``v`` on disk. The checkpoint is written when ``save`` or when
    the engine needs it (always then); with ``wait`` False, and a trainer that can, in the
    background (trainers/checkpoint.py) while the run goes on. A new checkpoint prunes older
    ones (``prune``; the committed version read from the lake) unless the caller prunes after its
    commit (``flows.steps.commit_step``, knowing the version). ``to_engine`` False: the
    checkpoint only (async mode's training side, whose engine only evaluates, takes weights
    before it does). Returns the checkpoint folder, or None when none is written."""
    weights = in_process_weights(rt) if to_engine else None
    path = rt.checkpoint_dir(weight_version)
    engine_reads_it = to_engine and weights is None  # so it must be on disk first
    writes_checkpoint = save or engine_reads_it
    if writes_checkpoint:
        save_checkpoint(rt, path, background=not wait and not engine_reads_it)
    fault_point("during_weight_handoff")
    if to_engine:
        hand_to_engine(rt, weights, weight_version, path, save)
    if writes_checkpoint and prune:  # a new folder (the hand-off alone changes nothing on disk)
        rt.prune_checkpoints(keep_version=weight_version)
    return str(path) if writes_checkpoint else None


def hand_to_engine(rt: Runtime, weights: dict | None, weight_version: int, path: Path,
                   saved: bool) -> None:
    """Give the engine weights ``weight_version``: ``weights`` in memory, or checkpoint ``path``."""
    if weights is not None and receives_broadcast(rt.engine):
        # a server restarted later loads the newest saved checkpoint, then the next sync
        rt.engine.update_weights_from_tensors(weights.items(), weight_version,
                                              str(path) if saved else None)
    elif weights is not None:
        rt.engine.load_state_dict(weights, weight_version)
    else:
        rt.engine.update_weights(str(path), weight_version)


def save_checkpoint(rt: Runtime, path, background: bool) -> None:
    """``rt.trainer.save(path)``; in the background when asked and the trainer has a writer."""
    if background and hasattr(rt.trainer, "checkpoint_writer"):
        rt.trainer.save(str(path), background=True)
    else:
        rt.trainer.save(str(path))


def wait_for_checkpoints(rt: Runtime) -> None:
    """Block until the trainer's background checkpoint write (if any) is on disk; raise its error."""
    writer = getattr(rt.trainer, "checkpoint_writer", None)
    if writer is not None:
        writer.wait()


def in_process_weights(rt: Runtime) -> dict | None:
    """HF-named weights to hand to the engine without a disk round trip, or None (an engine that
    reads checkpoints, or a trainer whose weights live in other processes)."""
    if not (hasattr(rt.engine, "load_state_dict") or receives_broadcast(rt.engine)):
        return None
    for name in ("hf_state_dict", "state_dict"):
        if hasattr(rt.trainer, name):
            return getattr(rt.trainer, name)()
    return None


def receives_broadcast(engine) -> bool:
    """An out-of-process engine fed tensors over a process group (SGLang's
    ``update_weights_from_distributed``: ``rollout.sglang.weight_sync: distributed``)."""
    config = getattr(engine, "config", None)
    return (getattr(config, "weight_sync", None) == "distributed"
            and hasattr(engine, "update_weights_from_tensors"))
