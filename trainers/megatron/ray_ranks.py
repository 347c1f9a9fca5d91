"""Megatron's ranks as Ray actors: :class:`RayRanks`, the launcher ``MegatronRanks`` drives
when ``cluster.ray_address`` is set and the world (TP x PP x DP) is larger than one.

Placement: one placement group, one bundle per rank ``{CPU: trainer_num_cpus, GPU: g}`` with
g = 1 when the ranks run on CUDA, else 0 (``cluster.placement_strategy``; PACK keeps a TP group
on as few nodes as possible). Rank r is the actor in bundle r. Under a GPU, Ray gives each actor
one device as ``cuda:0`` (its ``CUDA_VISIBLE_DEVICES``), so every rank's LOCAL_RANK is 0.

Rendezvous (``env://``): rank 0's actor reports its node's IP and a port free there; every
rank gets MASTER_ADDR/MASTER_PORT = those, RANK = r, WORLD_SIZE = world, and all build their
``MegatronTrainer`` at once (``init_process_group`` is collective). gloo on CPU, nccl on GPU.

Failure: actors never restart (a rank's optimizer shard would be lost). A call waits on every
rank with ``ray.wait``; the first error answer or dead actor ends it (``RankFailed`` /
``RankDied`` from ``MegatronRanks``, which kills every actor and frees the placement group), and
a call with no answer within ``call_timeout_s`` fails the same way.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from infra.cluster import actor_options, bundle, connect, placement_group
from infra.config import ClusterConfig, megatron_world_size
from infra.modeling import resolve_dtype
from trainers.megatron.ranks import (
    RANK_FAULT_ENV,
    Answer,
    MegatronRanks,
    RankDied,
    RankServer,
    gather_answers,
    rank_environment,
    start_rank,
)


def rank_gpus(device: str, cluster_gpus: float, world: int) -> float:
    """GPUs per rank: 1 for ``cuda``, 0 for ``cpu``; ``auto``: 1 when the cluster has a GPU
    for every rank (``cluster_gpus >= world``), else 0."""
    if device == "auto":
        return 1.0 if cluster_gpus >= world else 0.0
    return 1.0 if device == "cuda" else 0.0


USER = "megatron-ranks"  # this launcher's name on the process's Ray connection


class RankActor:
    """One Megatron rank inside a Ray actor."""

    def __init__(self, rank: int, world: int, threads: int) -> None:
        torch.set_num_threads(threads)
        self.rank, self.world = rank, world
        self.server: RankServer | None = None

    def address(self) -> tuple[str, int, int]:
        """(this node's IP as Ray knows it, a TCP port free on it now, this process's pid)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), port, os.getpid()

    def start(self, master_addr: str, master_port: int, config: Any, model_dir: str,
              kwargs: dict[str, Any]) -> Answer:
        os.environ.update(rank_environment(self.rank, self.world, 0, master_addr, master_port))
        self.server, answer = start_rank(self.rank, config, model_dir, kwargs)
        return answer

    def call(self, name: str, args: tuple) -> Answer:
        return self.server.handle(name, args)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


class RayRanks:
    """``world`` ``RankActor``s on one placement group (one bundle each)."""

    def __init__(self, config: Any, model_dir: str, cluster: ClusterConfig, device: str = "auto",
                 dtype: str = "auto", ray_cpus: int | None = None, **kwargs: Any) -> None:
        """``device``/``dtype``: the run's settings (auto | cpu | cuda, auto | fp32 | bf16),
        resolved against the cluster's GPUs, not this process's (the driver may have none)."""
        self.world = megatron_world_size(config)
        self.cluster = cluster
        self.actors: list[Any] = []
        self.pids: list[int] = []
        self.connection = connect(cluster, USER, num_cpus=ray_cpus)
        try:
            self._place(device)
        except BaseException:
            self.connection.release(USER)
            raise
        self._spec = (config, model_dir, {**kwargs, "dtype": resolve_dtype(
            dtype, "cuda" if self.num_gpus else "cpu")})

    def _place(self, device: str) -> None:
        import ray

        cpus = self.cluster.trainer_num_cpus
        self.num_gpus = rank_gpus(device, ray.cluster_resources().get("GPU", 0.0), self.world)
        self.pg = placement_group([bundle(cpus, self.num_gpus, {})] * self.world,
                                  self.cluster.placement_strategy,
                                  f"{self.world} megatron ranks", self.cluster.placement_timeout_s)
        fault = os.environ.get(RANK_FAULT_ENV)
        env = {"runtime_env": {"env_vars": {RANK_FAULT_ENV: fault}}} if fault else {}
        remote = ray.remote(RankActor)
        self.actors = [remote.options(**actor_options(
            self.pg, r, cpus, self.num_gpus, {}, max_restarts=0, max_task_retries=0, **env)).remote(
            r, self.world, max(1, int(cpus))) for r in range(self.world)]

    def start(self, timeout_s: float | None) -> list[Answer]:
        addresses = self._wait([a.address.remote() for a in self.actors],
                               self.cluster.placement_timeout_s)
        self.pids = [pid for _, _, pid in addresses]
        master_addr, master_port, _ = addresses[0]
        config, model_dir, kwargs = self._spec
        return self._wait([a.start.remote(master_addr, master_port, config, model_dir, kwargs)
                           for a in self.actors], timeout_s)

    def call(self, name: str, args: tuple, timeout_s: float | None) -> list[Answer]:
        import ray

        # one copy of the arguments in the object store, read by every rank
        ref = ray.put(args)
        return self._wait([a.call.remote(name, ref) for a in self.actors], timeout_s)

    def _wait(self, refs: list[Any], timeout_s: float | None) -> list[Any]:
        """Each rank's answer in rank order (``gather_answers``); a dead actor is ``RankDied``."""
        import ray

        index = {ref: r for r, ref in enumerate(refs)}
        pending = list(refs)

        def receive(wait_s: float, answered: set[int]) -> tuple[int, Any] | None:
            nonlocal pending
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            if not ready:
                return None
            rank = index[ready[0]]
            try:
                return rank, ray.get(ready[0])
            except ray.exceptions.RayActorError as err:
                raise RankDied(rank, f"its Ray actor died ({type(err).__name__}): {err}") from None

        return gather_answers(len(refs), receive, timeout_s)

    def stop(self, graceful: bool) -> None:
        """``graceful``: let each rank close its trainer and process group (bounded), then kill
        every actor and free the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not self.actors:
            return
        if graceful:
            refs = [a.close.remote() for a in self.actors]
            ray.wait(refs, num_returns=len(refs), timeout=30)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(self.pg)
        self.actors = []
        self.connection.release(USER)


def ray_megatron_trainer(config: Any, model_dir: str, cluster: ClusterConfig, **kwargs: Any
                         ) -> MegatronRanks:
    """``MegatronRanks`` over ``RayRanks(config, model_dir, cluster, **kwargs)``; each call
    bounded by ``cluster.trainer_call_timeout_s``."""
    return MegatronRanks(RayRanks(config, model_dir, cluster, **kwargs),
                         call_timeout_s=cluster.trainer_call_timeout_s)
