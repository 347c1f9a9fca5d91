"""Megatron's ranks behind the ``Trainer`` interface, whatever launched them.

Two halves, one per side of the wire:

- rank side, :class:`RankServer`: one per rank process; builds the real ``MegatronTrainer``
  and answers each call with ``("ok", result)`` (rank 0's result, ``None`` from the others)
  or ``("err", traceback)``.
- driver side, :class:`MegatronRanks`: the ``Trainer`` interface over a :class:`RankLauncher`
  (how the ranks were started and how a message reaches one). Calls are collective: sent to
  every rank, every answer gathered, rank 0's returned.

Launchers: ``trainers/megatron/launch.ProcessRanks`` (torch.multiprocessing, one machine) and
``trainers/megatron/ray_ranks.RayRanks`` (one Ray actor per rank on a placement group).

Failure: the first rank that raises or dies ends the call with :class:`RankFailed` (or its
:class:`RankDied`), naming the rank and its traceback; every rank is stopped first, since the
others are stuck in a collective that will never complete. The iteration fails before its
commit point (the ``train_steps`` row) and ``rlake resume`` continues from the last committed
checkpoint, as for a dead trainer actor. A call with no answer within ``call_timeout_s`` fails
the same way (``None``: wait as long as the ranks live).
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import torch

from infra.faults import parse_member_fault
from trainers.base import TrainBatch

RANK_FAULT_ENV = "RLAKE_MEGATRON_RANK_FAULT"  # "r:n": rank r's process exits in its n-th train
RESUME_HINT = "resume the run from its last checkpoint (rlake resume)"
# after a rank's error answer, how long its peers get to answer or be found dead (a rank that
# died makes its peers' collectives fail: the death, not their errors, is what to report)
SETTLE_S = 10.0
# what every rank answers: ("ok", rank 0's result or None) | ("err", traceback text)
Answer = tuple[str, Any]
POLL_S = 1.0  # how often a silent rank is looked at (dead? past the deadline?)


class RankFailed(RuntimeError):
    """A Megatron rank raised (or did not answer in time); every rank has been stopped."""

    def __init__(self, rank: int | None, detail: str, what: str = "failed") -> None:
        self.rank, self.detail = rank, detail
        who = "a megatron rank" if rank is None else f"megatron rank {rank}"
        super().__init__(f"{who} {what}; all ranks stopped, {RESUME_HINT}:\n{detail}")


class RankDied(RankFailed):
    """A Megatron rank's process is gone (killed, crashed, out of memory)."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(rank, detail, what="died")


def is_error(answer: Any) -> bool:
    return isinstance(answer, tuple) and answer[:1] == ("err",)


def gather_answers(world: int, receive: Callable[[float, set[int]], tuple[int, Any] | None],
                   timeout_s: float | None, settle_s: float = SETTLE_S) -> list[Any]:
    """Every rank's answer, in rank order, whichever launcher carries them.

    ``receive(wait_s, answered)`` returns the next ``(rank, answer)`` within ``wait_s`` or None,
    and raises ``RankDied`` for a rank gone without answering. After the first error answer the
    others get ``settle_s`` more (they may be stuck in a collective with the broken rank, and a
    death found meanwhile is the cause to report); without one, ranks still silent after
    ``timeout_s`` fail the call. A rank that never answered within the settle time counts as
    ``("ok", None)``: the error answer is what the caller raises."""
    answers: dict[int, Any] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    settle: float | None = None
    while len(answers) < world:
        end = settle if settle is not None else deadline
        left = None if end is None else end - time.monotonic()
        if left is not None and left <= 0:
            if settle is not None:
                break
            silent = sorted(set(range(world)) - set(answers))
            raise RankFailed(None, f"ranks {silent} gave no answer within {timeout_s}s", what="timed out")
        got = receive(POLL_S if left is None else min(POLL_S, left), set(answers))
        if got is None:
            continue
        rank, answer = got
        answers[rank] = answer
        if settle is None and is_error(answer):
            settle = time.monotonic() + settle_s
    return [answers.get(r, ("ok", None)) for r in range(world)]


def parse_rank_fault(spec: str | None, rank: int) -> int | None:
    """``"r:n"`` -> n when r == ``rank`` (this rank exits in its n-th train call), else None."""
    return parse_member_fault(spec, rank, RANK_FAULT_ENV, "rank")


def rank_environment(rank: int, world: int, local_rank: int, master_addr: str,
                     master_port: int) -> dict[str, str]:
    """The torchrun variables ``init_distributed`` reads (``env://`` rendezvous)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


class RankServer:
    """One rank's trainer; ``handle`` runs one call and never raises."""

    def __init__(self, rank: int, config: Any, model_dir: str, kwargs: dict[str, Any]) -> None:
        from trainers.megatron.trainer import MegatronTrainer

        self.rank = rank
        self.die_at = parse_rank_fault(os.environ.get(RANK_FAULT_ENV), rank)
        self.trains = 0
        self.trainer = MegatronTrainer(config, model_dir, **kwargs)

    def handle(self, name: str, args: tuple) -> Answer:
        if name == "train":
            self.trains += 1
            if self.die_at == self.trains:
                os._exit(1)  # fault injection: the rank's process dies mid-iteration
        try:
            if name == "__getattr__":
                result = getattr(self.trainer, args[0])
            else:
                result = getattr(self.trainer, name)(*args)
            if name == "hf_state_dict" and result is not None:
                # CPU copies: views of live (maybe CUDA) parameters must not leave the rank
                result = {k: v.to("cpu", copy=True) for k, v in result.items()}
            return ("ok", result if self.rank == 0 else None)
        except Exception:
            return ("err", traceback.format_exc())

    def close(self) -> None:
        self.trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def start_rank(rank: int, config: Any, model_dir: str, kwargs: dict[str, Any]
               ) -> tuple[RankServer | None, Answer]:
    """(server, ("ok", None)), or (None, ("err", traceback)) when the trainer cannot be built."""
    try:
        return RankServer(rank, config, model_dir, kwargs), ("ok", None)
    except Exception:
        return None, ("err", traceback.format_exc())


class RankLauncher(Protocol):
    """How ranks are started and reached. ``call`` sends ``(name, args)`` to every rank and
    returns their answers in rank order; it raises ``RankDied`` for a rank whose process is gone
    and ``RankFailed(None, ...)`` past ``timeout_s`` (it does not stop the ranks itself)."""

    world: int

    def start(self, timeout_s: float | None) -> list[Answer]: ...

    def call(self, name: str, args: tuple, timeout_s: float | None) -> list[Answer]: ...

    def stop(self, graceful: bool) -> None: ...


class MegatronRanks:
    """The ``Trainer`` interface over ``world`` Megatron ranks (calls are collective)."""

    def __init__(self, launcher: RankLauncher, call_timeout_s: float | None = None) -> None:
        self.launcher = launcher
        self.world = launcher.world
        self.call_timeout_s = call_timeout_s
        self._stopped = False
        self._checked(lambda: launcher.start(call_timeout_s))
        self.weight_version = int(self._call("__getattr__", "weight_version"))
        # read by the runtime (``trainer_needs_v0``): v0 is the KL reference, never pruned
        self.uses_reference = bool(self._call("__getattr__", "uses_reference"))

    def _checked(self, send: Callable[[], list[Answer]]) -> Any:
        """Rank 0's result; any rank's error (raised, dead, silent) stops all ranks first."""
        if self._stopped:
            raise RankFailed(None, "the ranks were stopped earlier (close, or a failed call)",
                             what="is not running")
        try:
            answers = send()
        except BaseException:  # dead, silent, or the driver interrupted: no rank may linger
            self._stop(graceful=False)
            raise
        for rank, (status, payload) in enumerate(answers):
            if status == "err":
                self._stop(graceful=False)
                raise RankFailed(rank, str(payload))
        return answers[0][1]

    def _call(self, name: str, *args: Any) -> Any:
        return self._checked(lambda: self.launcher.call(name, args, self.call_timeout_s))

    def _stop(self, graceful: bool) -> None:
        if not self._stopped:
            self._stopped = True
            self.launcher.stop(graceful)

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
        self._stop(graceful=True)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
