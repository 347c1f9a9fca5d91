"""The trainer as a Ray actor, behind the ``Trainer`` interface (``RayTrainer``).

The actor builds the real trainer (torch, or Megatron-core with a world of one: larger worlds run
each rank as its own actor, trainers/megatron/ray_ranks.py) from a picklable ``build`` callable and runs every call in its process, 1 torch thread. The proxy
forwards ``train``, ``train_sft``, ``save``, ``load`` and whatever else the trainer offers
(``set_lr``, ``state_dict``, ``uses_reference``, ...: the names are read from the actor once), and
mirrors ``weight_version`` after each call.

A trainer actor never restarts: its optimizer state would be lost silently. A dead actor makes
the call raise ``TrainerActorDied``; the iteration fails before its commit point (the
``train_steps`` row), and ``rlake resume`` starts from the last committed checkpoint.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

from infra.cluster import actor_options, bundle, connect, placement_group
from infra.config import ClusterConfig
from trainers.base import Trainer

TRAINER_FAULT_ENV = "RLAKE_TRAINER_FAULT"  # "n": the trainer actor's process exits in its n-th train


# attributes of the real trainer that only make sense in its own process: a background
# checkpoint writer (a thread) cannot be driven through the actor
LOCAL_ONLY = frozenset({"checkpoint_writer"})

class TrainerActorDied(RuntimeError):
    """The trainer actor's process is gone; the run must resume from its last checkpoint."""


class TrainerWorker:
    """The real trainer inside a Ray actor."""

    def __init__(self, build: Callable[[], Trainer]) -> None:
        torch.set_num_threads(1)
        self.trainer = build()
        self.trains = 0
        fault = os.environ.get(TRAINER_FAULT_ENV, "")
        self.die_at = int(fault) if fault.strip().isdigit() else None

    def describe(self) -> dict[str, str]:
        """Public attribute -> "method" | "value" (what the proxy may forward)."""
        out = {}
        for name in dir(type(self.trainer)) + list(vars(self.trainer)):
            if name.startswith("_"):
                continue
            static = inspect.getattr_static(self.trainer, name)  # never runs a property
            out[name] = "method" if callable(static) and not isinstance(static, property) else "value"
        return out

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, int]:
        if name == "train":
            self.trains += 1
            if self.die_at == self.trains:
                os._exit(1)  # fault injection: the trainer's process dies mid-iteration
        result = getattr(self.trainer, name)(*args, **kwargs)
        return result, self.trainer.weight_version

    def get(self, name: str) -> Any:
        return getattr(self.trainer, name)

    def set(self, name: str, value: Any) -> None:
        setattr(self.trainer, name, value)


class RayTrainer:
    """A ``Trainer`` whose work happens in a Ray actor placed on its own placement group."""

    def __init__(self, build: Callable[[], Trainer], cluster: ClusterConfig,
                 ray_cpus: int | None = None) -> None:
        self.connection = connect(cluster, "trainer", num_cpus=ray_cpus)
        import ray

        self.pg = placement_group([bundle(cluster.trainer_num_cpus, cluster.trainer_num_gpus, {})],
                                  "PACK", "the trainer actor", cluster.placement_timeout_s)
        fault = os.environ.get(TRAINER_FAULT_ENV)
        env = {"runtime_env": {"env_vars": {TRAINER_FAULT_ENV: fault}}} if fault else {}
        self.actor = ray.remote(TrainerWorker).options(**actor_options(
            self.pg, 0, cluster.trainer_num_cpus, cluster.trainer_num_gpus, {}, max_restarts=0,
            **env)).remote(build)
        self._kinds = self._get(self.actor.describe.remote())
        self._version = self._get(self.actor.get.remote("weight_version"))

    def _get(self, ref: Any) -> Any:
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as err:
            raise TrainerActorDied(f"the trainer actor died ({type(err).__name__}); resume the "
                                   "run from its last checkpoint (rlake resume)") from None

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        result, self._version = self._get(self.actor.call.remote(name, *args, **kwargs))
        return result

    @property
    def weight_version(self) -> int:
        return self._version

    @weight_version.setter
    def weight_version(self, value: int) -> None:
        self._get(self.actor.set.remote("weight_version", value))
        self._version = value

    def train(self, batch: Any) -> dict[str, float]:
        return self._call("train", batch)

    def train_sft(self, batch: Any) -> dict[str, float]:
        return self._call("train_sft", batch)

    def save(self, checkpoint_dir: str) -> None:
        """Synchronous, inside the actor: a background write there could not be waited for
        from here (``checkpoint_writer`` is not forwarded, so callers never ask for one)."""
        self._call("save", checkpoint_dir)

    def load(self, checkpoint_dir: str) -> None:
        self._call("load", checkpoint_dir)

    def __getattr__(self, name: str) -> Any:
        # only reached for names this class lacks: forward what the real trainer offers
        kinds = self.__dict__.get("_kinds") or {}
        if name.startswith("_") or name not in kinds or name in LOCAL_ONLY:
            raise AttributeError(name)
        if kinds[name] == "value":
            return self._get(self.actor.get.remote(name))
        return lambda *args, **kwargs: self._call(name, *args, **kwargs)

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if getattr(self, "actor", None) is None:
            return
        try:
            self._call("close") if self._kinds.get("close") == "method" else None
        except TrainerActorDied:
            pass
        ray.kill(self.actor, no_restart=True)
        remove_placement_group(self.pg)
        self.actor = None
        self.connection.release("trainer")
