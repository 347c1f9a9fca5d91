"""Launch the megatron backend from one driver process (``rlake run``).

``make_megatron_trainer(config, model_dir, ...)``: world size = tensor x pipeline x data
parallel sizes (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
``data_parallel_size``; default 1 each). World 1 -> a ``MegatronTrainer`` in this process.
Larger -> :class:`SpawnedMegatronTrainer`: ``world`` worker processes (torch.multiprocessing,
spawn), one rank each, rendezvous on a free local port (gloo on CPU, nccl on GPU); the driver
sends each call to every rank and returns rank 0's answer. It has the Trainer interface.

Under ``torchrun`` (WORLD_SIZE set in the environment) build ``MegatronTrainer`` directly in
every rank instead: ``init_distributed`` reads the torchrun environment.
"""

from __future__ import annotations

import os
import queue
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp

from trainers.base import TrainBatch
from trainers.megatron.losses import cfg_get


def world_size_for(config: Any) -> int:
    """tensor_model_parallel_size * pipeline_model_parallel_size * data_parallel_size."""
    sizes = [int(cfg_get(config, k, 1)) for k in ("tensor_model_parallel_size",
                                                   "pipeline_model_parallel_size",
                                                   "data_parallel_size")]
    for k, v in zip(("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "data_parallel_size"), sizes, strict=True):
        if v < 1:
            raise ValueError(f"trainer.{k}={v}: must be >= 1")
    return sizes[0] * sizes[1] * sizes[2]


def _worker(rank: int, world: int, port: int, threads: int, config: Any, model_dir: str,
            kwargs: dict[str, Any], inbox: Any, outbox: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    try:
        from trainers.megatron.trainer import MegatronTrainer
        trainer = MegatronTrainer(config, model_dir, **kwargs)
        outbox.put(("ok", None))
    except Exception:  # report and exit: the driver raises
        outbox.put(("err", traceback.format_exc()))
        return
    while True:
        msg = inbox.get()
        if msg is None:
            break
        name, args = msg
        try:
            if name == "__getattr__":
                result = getattr(trainer, args[0])
            else:
                result = getattr(trainer, name)(*args)
            if name == "hf_state_dict" and result is not None:
                # CPU copies: views of live parameters must not cross the queue (shared memory)
                result = {k: v.to("cpu", copy=True) for k, v in result.items()}
            outbox.put(("ok", result if rank == 0 else None))
        except Exception:
            outbox.put(("err", traceback.format_exc()))
    trainer.close()
    torch.distributed.destroy_process_group()


class SpawnedMegatronTrainer:
    """A group of spawned ranks behind the Trainer interface (calls are collective)."""

    def __init__(self, config: Any, model_dir: str, threads_per_rank: int = 1,
                 **kwargs: Any) -> None:
        from trainers.megatron.model import free_port

        self.world = world_size_for(config)
        ctx = mp.get_context("spawn")
        port = free_port()
        self._inboxes = [ctx.Queue() for _ in range(self.world)]
        self._outboxes = [ctx.Queue() for _ in range(self.world)]
        self._procs = [ctx.Process(target=_worker, daemon=True, args=(
            r, self.world, port, threads_per_rank, config, model_dir, kwargs,
            self._inboxes[r], self._outboxes[r])) for r in range(self.world)]
        for p in self._procs:
            p.start()
        self._collect()
        self.weight_version = int(self._call("__getattr__", "weight_version"))

    def _collect(self) -> Any:
        answers = [self._answer(r) for r in range(self.world)]
        errors = [a[1] for a in answers if a[0] == "err"]
        if errors:
            self.close()
            raise RuntimeError(f"megatron rank failed:\n{errors[0]}")
        return answers[0][1]

    def _answer(self, rank: int) -> tuple[str, Any]:
        """Rank ``rank``'s next answer; an error answer if the process died without one."""
        while True:
            try:
                return self._outboxes[rank].get(timeout=1.0)
            except queue.Empty:
                if not self._procs[rank].is_alive():
                    return ("err", f"rank {rank} exited with code "
                                   f"{self._procs[rank].exitcode} without answering")

    def _call(self, name: str, *args: Any) -> Any:
        for box in self._inboxes:
            box.put((name, args))
        return self._collect()

    def train(self, batch: TrainBatch) -> dict[str, float]:
        out = self._call("train", batch)
        self.weight_version += 1
        return out

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        return self._call("train_sft", batch)

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._call("compute_logprobs", batch)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self._call("hf_state_dict")

    def set_lr(self, lr: float) -> None:
        self._call("set_lr", lr)

    def save(self, checkpoint_dir: str) -> None:
        self._call("save", checkpoint_dir)

    def load(self, checkpoint_dir: str) -> None:
        self._call("load", checkpoint_dir)
        self.weight_version = int(self._call("__getattr__", "weight_version"))

    def close(self) -> None:
        """Stop the ranks (idempotent)."""
        for box, p in zip(self._inboxes, self._procs, strict=True):
            if p.is_alive():
                box.put(None)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def make_megatron_trainer(config: Any, model_dir: str, **kwargs: Any):
    """``MegatronTrainer`` in this process for world size 1 (or under torchrun), else a
    :class:`SpawnedMegatronTrainer` with one process per rank."""
    if world_size_for(config) == 1 or "WORLD_SIZE" in os.environ:
        from trainers.megatron.trainer import MegatronTrainer
        return MegatronTrainer(config, model_dir, **kwargs)
    return SpawnedMegatronTrainer(config, model_dir, **kwargs)
