"""The two contained patches that let megatron-core's GPTModel (local layer spec) run on CPU.

1. megatron's CUDA RNG tracker (``tensor_parallel.random._CUDA_RNG_STATE_TRACKER``) is replaced by
   :class:`CpuRNGStatesTracker`, the same named-state tracker backed by the CPU generator.
2. ``torch.cuda.current_device`` answers ``"cpu"`` (megatron allocates buffers on it).

Apply them only when the megatron backend runs on CPU (``apply_cpu_patches`` is a no-op when
CUDA is available); ``undo`` restores exactly what was there before. The patches are
process-global, so the trainer applies them for its whole lifetime and undoes them on close.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

_LIVE = [0]  # live handles
_SAVED: dict[str, Any] = {}  # what the patches replaced


class CpuRNGStatesTracker:
    """megatron's ``CudaRNGStatesTracker`` interface on the CPU generator.

    ``add(name, seed)`` stores the CPU generator state that ``torch.manual_seed(seed)`` gives;
    ``fork(name)`` swaps that state in, runs the block, stores the advanced state back under
    ``name`` and restores the state the generator had before the block.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"rng seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


@dataclass
class CpuPatches:
    """A handle on the installed patches; ``undo`` releases it. The patches are reference
    counted: the originals come back when the last live handle is undone."""

    active: bool = False

    def undo(self) -> None:
        """Release this handle; restore the RNG tracker globals and ``torch.cuda.current_device``
        when no other handle is live."""
        if not self.active:
            return
        self.active = False
        _LIVE[0] -= 1
        if _LIVE[0] == 0:
            from megatron.core.tensor_parallel import random as mrandom

            mrandom._CUDA_RNG_STATE_TRACKER = _SAVED["tracker"]
            mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = _SAVED["tracker_initialized"]
            torch.cuda.current_device = _SAVED["current_device"]
            _SAVED.clear()


def _cpu_current_device() -> str:
    return "cpu"


def patches_active() -> bool:
    """Whether the CPU patches are installed now."""
    return _LIVE[0] > 0


def apply_cpu_patches(seed: int = 1234, force: bool = False) -> CpuPatches:
    """Install the CPU patches unless CUDA is available (or ``force``); return a handle to undo.

    The tracker gets megatron's three named states, seeded as
    ``model_parallel_cuda_manual_seed`` does: tensor-parallel ``seed + 2718 + tp_rank``,
    data-parallel ``seed``, expert-parallel ``seed + 1024 + 100 * ep_rank + tp_rank``
    (ranks 0 when model parallel is not initialised yet). When already installed, the
    installed tracker stays and the handle only adds a reference.
    """
    if torch.cuda.is_available() and not force:
        return CpuPatches()
    if _LIVE[0] > 0:
        _LIVE[0] += 1
        return CpuPatches(active=True)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    _SAVED.update(tracker=mrandom._CUDA_RNG_STATE_TRACKER,
                  tracker_initialized=mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED,
                  current_device=torch.cuda.current_device)
    initialized = ps.model_parallel_is_initialized()
    tp_rank = ps.get_tensor_model_parallel_rank() if initialized else 0
    ep_rank = ps.get_expert_model_parallel_rank() if initialized else 0
    tracker = CpuRNGStatesTracker()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + tp_rank)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    _LIVE[0] = 1
    return CpuPatches(active=True)


@contextlib.contextmanager
def cpu_patches(seed: int = 1234, force: bool = False) -> Iterator[CpuPatches]:
    """Context manager form of :func:`apply_cpu_patches`: undone on exit."""
    patches = apply_cpu_patches(seed=seed, force=force)
    try:
        yield patches
    finally:
        patches.undo()

