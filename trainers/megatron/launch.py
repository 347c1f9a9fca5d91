"""Launch the megatron backend from one driver process (``rlake run``).

``make_megatron_trainer(config, model_dir, ...)``: world size = tensor x pipeline x data
parallel sizes (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
``data_parallel_size``; default 1 each). World 1 -> a ``MegatronTrainer`` in this process.
Larger -> :class:`SpawnedMegatronTrainer`: ``MegatronRanks`` (trainers/megatron/ranks.py) over
:class:`ProcessRanks`, ``world`` worker processes (torch.multiprocessing, spawn), one rank each,
rendezvous on a free local port (gloo on CPU, nccl on GPU). With Ray on, the runtime builds the
ranks as Ray actors instead (trainers/megatron/ray_ranks.py).

Under ``torchrun`` (WORLD_SIZE set in the environment) build ``MegatronTrainer`` directly in
every rank instead: ``init_distributed`` reads the torchrun environment.

A rank process dies with the process that started it (``PR_SET_PDEATHSIG``, as the async
rollout process: ``infra.spawned.die_with_parent``): after a ``kill -9`` of the run no rank
(~540 MB each) is left waiting on its inbox. The signal follows the *thread* that started the
child, so the ranks are started from one thread that lives as long as this process
(``infra.spawned.in_launcher``), not from whichever thread built the trainer; a rank also checks its
parent's pid while it waits for a call (a last guard where prctl is not available).
"""

from __future__ import annotations

import os
import queue
from typing import Any

import torch
import torch.multiprocessing as mp

from infra.config import megatron_world_size
from infra.spawned import die_with_parent, in_launcher
from trainers.megatron.ranks import (
    Answer,
    MegatronRanks,
    RankDied,
    gather_answers,
    rank_environment,
    start_rank,
)

PARENT_CHECK_S = 1.0  # how often a waiting rank looks whether its driver is still there


def _next_message(inbox: Any, parent_pid: int) -> Any:
    """The next call from the driver; ``None`` (close) once the driver is gone."""
    while True:
        try:
            return inbox.get(timeout=PARENT_CHECK_S)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return None


def _worker(rank: int, world: int, port: int, threads: int, config: Any, model_dir: str,
            kwargs: dict[str, Any], inbox: Any, outbox: Any, parent_pid: int) -> None:
    die_with_parent(parent_pid)  # SIGKILL when the driver dies (kill -9 too)
    os.environ.update(rank_environment(rank, world, rank, "127.0.0.1", port))
    torch.set_num_threads(threads)
    server, answer = start_rank(rank, config, model_dir, kwargs)
    outbox.put((rank, answer))
    if server is None:
        return  # the driver raises
    while (msg := _next_message(inbox, parent_pid)) is not None:
        outbox.put((rank, server.handle(*msg)))
    if os.getppid() != parent_pid:
        os._exit(1)  # the driver is gone: no peer to close the process group with
    server.close()


class ProcessRanks:
    """``world`` spawned processes on this machine, one inbox each and one shared outbox."""

    def __init__(self, config: Any, model_dir: str, threads_per_rank: int = 1,
                 **kwargs: Any) -> None:
        self.world = megatron_world_size(config)
        self._spec = (config, model_dir, threads_per_rank, kwargs)
        self._procs: list[Any] = []

    def start(self, timeout_s: float | None) -> list[Answer]:
        from infra.ports import free_port

        config, model_dir, threads, kwargs = self._spec
        ctx = mp.get_context("spawn")
        port = free_port()
        self._inboxes = [ctx.Queue() for _ in range(self.world)]
        self._outbox = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, daemon=True, args=(
            r, self.world, port, threads, config, model_dir, kwargs, self._inboxes[r],
            self._outbox, os.getpid())) for r in range(self.world)]
        in_launcher(lambda: [p.start() for p in self._procs])
        return self._gather(timeout_s)

    def call(self, name: str, args: tuple, timeout_s: float | None) -> list[Answer]:
        for box in self._inboxes:
            box.put((name, args))
        return self._gather(timeout_s)

    def _gather(self, timeout_s: float | None) -> list[Answer]:
        return gather_answers(self.world, self._receive, timeout_s)

    def _receive(self, wait_s: float, answered: set[int]) -> tuple[int, Answer] | None:
        """The next answer from the shared outbox, or None; ``RankDied`` for a rank whose
        process is gone without answering."""
        try:
            return self._outbox.get(timeout=wait_s)
        except queue.Empty:
            pass
        for r, p in enumerate(self._procs):
            if r not in answered and not p.is_alive():
                raise RankDied(r, f"its process exited with code {p.exitcode} without answering")
        return None

    def stop(self, graceful: bool) -> None:
        """``graceful``: ask each rank to close (30 s), then terminate what is left."""
        for box, p in zip(getattr(self, "_inboxes", []), self._procs, strict=True):
            if graceful and p.is_alive():
                box.put(None)
        for p in self._procs:
            p.join(timeout=30 if graceful else 0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)


class SpawnedMegatronTrainer(MegatronRanks):
    """``MegatronRanks`` over spawned processes (the no-Ray launcher)."""

    def __init__(self, config: Any, model_dir: str, threads_per_rank: int = 1,
                 **kwargs: Any) -> None:
        super().__init__(ProcessRanks(config, model_dir, threads_per_rank, **kwargs))


def make_megatron_trainer(config: Any, model_dir: str, **kwargs: Any):
    """``MegatronTrainer`` in this process for world size 1 (or under torchrun), else a
    :class:`SpawnedMegatronTrainer` with one process per rank."""
    if megatron_world_size(config) == 1 or "WORLD_SIZE" in os.environ:
        from trainers.megatron.trainer import MegatronTrainer
        return MegatronTrainer(config, model_dir, **kwargs)
    return SpawnedMegatronTrainer(config, model_dir, **kwargs)
