"""The two CPU patches: installed, behaving like megatron's tracker, reference counted, undone."""

from __future__ import annotations

import pytest
import torch
from megatron.core.tensor_parallel import random as mrandom

from trainers.megatron.cpu_patches import (
    CpuRNGStatesTracker,
    apply_cpu_patches,
    cpu_patches,
    patches_active,
)

pytestmark = pytest.mark.megatron


def test_tracker_fork_uses_and_advances_named_state():
    tracker = CpuRNGStatesTracker()
    tracker.add("a", 11)
    with pytest.raises(ValueError, match="seed 11"):
        tracker.add("b", 11)
    torch.manual_seed(0)
    outside = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)  # caller's stream untouched
    with tracker.fork("a"):
        second = torch.rand(3)
    torch.manual_seed(11)
    assert torch.equal(first, torch.rand(3)) and torch.equal(second, torch.rand(3))
    with pytest.raises(KeyError):
        with tracker.fork("missing"):
            pass


def test_patches_install_and_undo():
    original_device = torch.cuda.current_device
    original_tracker = mrandom._CUDA_RNG_STATE_TRACKER
    with cpu_patches(force=True) as outer:
        assert patches_active() and torch.cuda.current_device() == "cpu"
        tracker = mrandom.get_cuda_rng_tracker()
        assert isinstance(tracker, CpuRNGStatesTracker)
        with tracker.fork():  # megatron's default name: the model-parallel state
            torch.rand(1)
        inner = apply_cpu_patches(force=True)
        assert mrandom.get_cuda_rng_tracker() is tracker  # shared, not re-seeded
        outer.undo()
        assert patches_active() and torch.cuda.current_device() == "cpu"
        inner.undo()
    assert not patches_active()
    assert torch.cuda.current_device is original_device
    assert mrandom._CUDA_RNG_STATE_TRACKER is original_tracker
