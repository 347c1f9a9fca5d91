"""trainers/adamw.py: the CPU trainer's AdamW equals torch.optim.AdamW bit for bit (parameters and
state, through learning-rate changes, missing gradients and checkpoints in either direction), and
a CPU training step no longer imports torch._dynamo."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer_fixtures import build_model
from trainers.adamw import AdamW

torch.set_num_threads(1)
REPO_ROOT = Path(__file__).resolve().parents[1]
HYPER = {"lr": 3e-3, "weight_decay": 0.1, "betas": (0.9, 0.95)}


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in
            ((7, 5), (5,), (3, 4, 2), ())]


def _grads(params, step: int) -> None:
    """Gradients of a fixed nonlinear loss; parameter 1 has none on odd steps."""
    loss = sum((p.tanh() * (i + 1 + step)).pow(2).sum() for i, p in enumerate(params) if
               not (i == 1 and step % 2))
    loss.backward()


def _run(optimizer, params, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad(set_to_none=True)
        _grads(params, step)
        if step == 3:
            for group in optimizer.param_groups:
                group["lr"] = 1e-3
        optimizer.step()


def _assert_same(a_params, b_params, a_opt, b_opt) -> None:
    for a, b in zip(a_params, b_params, strict=True):
        assert torch.equal(a, b)
    sa, sb = a_opt.state_dict(), b_opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for index, values in sa["state"].items():
        assert values.keys() == sb["state"][index].keys()
        for key, value in values.items():
            other = sb["state"][index][key]
            assert value.dtype == other.dtype and torch.equal(value, other), (index, key)


def test_it_equals_torch_adamw_bit_for_bit():
    ours, theirs = _params(0), _params(0)
    a, b = AdamW(ours, **HYPER), torch.optim.AdamW(theirs, **HYPER)
    _run(a, ours, range(8))
    _run(b, theirs, range(8))
    _assert_same(ours, theirs, a, b)
    assert not torch.equal(ours[0], _params(0)[0])  # it moved


@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
def test_checkpoints_load_either_way_and_continue_identically(direction):
    """A state saved after 3 steps by one class, loaded by the other, continues exactly as the
    uninterrupted torch optimizer does."""
    reference = _params(1)
    ref_opt = torch.optim.AdamW(reference, **HYPER)
    _run(ref_opt, reference, range(6))

    first = _params(1)
    first_cls, second_cls = ((torch.optim.AdamW, AdamW) if direction == "torch_to_ours"
                             else (AdamW, torch.optim.AdamW))
    first_opt = first_cls(first, **HYPER)
    _run(first_opt, first, range(3))
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    resumed_opt = second_cls(resumed, lr=1.0, weight_decay=0.0)  # the state brings its own
    resumed_opt.load_state_dict(first_opt.state_dict())
    _run(resumed_opt, resumed, range(3, 6))
    _assert_same(resumed, reference, resumed_opt, ref_opt)


def test_a_state_of_another_shape_is_refused():
    opt = AdamW(_params(0)[:2], **HYPER)
    other = torch.optim.AdamW(_params(0), **HYPER)
    with pytest.raises(ValueError, match="param groups of other sizes"):
        opt.load_state_dict(other.state_dict())


def test_a_cpu_training_step_imports_no_dynamo(tmp_path):
    """The trainer's optimizer is the only thing of a CPU run that imported torch._dynamo."""
    model_dir = build_model(tmp_path)
    code = (
        "import sys\n"
        "from tests.trainer_fixtures import make_batch, trainer\n"
        f"tr = trainer({model_dir!r}, 4)\n"
        "metrics = tr.train(make_batch([1.0, 0.0, 0.0, 1.0], seed=1))\n"
        "tr.save(sys.argv[1])\n"
        "tr.load(sys.argv[1])\n"
        "assert metrics['optimizer_steps'] == 1.0, metrics\n"
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo')\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ckpt")], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "no dynamo"


@pytest.mark.parametrize("kwargs, message", [
    ({"betas": (1.0, 0.99)}, "Invalid beta parameter at index 0: 1.0"),
    ({"betas": (-0.1, 0.99)}, "Invalid beta parameter at index 0: -0.1"),
    ({"betas": (0.9, 1.0)}, "Invalid beta parameter at index 1: 1.0"),
    ({"lr": -1e-3}, "Invalid learning rate: -0.001"),
    ({"eps": -1.0}, "Invalid epsilon value: -1.0"),
    ({"weight_decay": -0.1}, "Invalid weight_decay value: -0.1"),
])
def test_bad_hyperparameters_are_refused_as_torch_refuses_them(kwargs, message):
    """beta2 = 1 divided by a zero bias correction (every weight NaN, no error) and beta1 = 1
    raised ZeroDivisionError mid-run: refused when built, with torch.optim.AdamW's message."""
    hyper = {**HYPER, **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        torch.optim.AdamW(_params(0), **hyper)
    with pytest.raises(ValueError, match=re.escape(message)):
        AdamW(_params(0), **hyper)
