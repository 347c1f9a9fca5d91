"""AdamW for the CPU trainer: torch.optim.AdamW's single-tensor arithmetic (the path torch takes
for CPU tensors), written out without ``torch.optim``.

Why: every ``torch.optim.Optimizer`` imports ``torch._dynamo`` when it is built, stepped or
zeroed (its methods are wrapped by ``torch._disable_dynamo``), 1.4-2.1 s of CPU measured here:
a fifth of a run's start-up on two cores, for a module the CPU trainer never uses. The update
below is the same tensor operations in the same order with the same Python-float scalars, so
its parameters and state equal torch's bit for bit on CPU (tests/test_adamw.py), and
``state_dict`` is torch's format: checkpoints load into either. CUDA keeps torch's fused AdamW
(``make_adamw``).

Per parameter θ with gradient g at step t = 1, 2, ... (learning rate η, weight decay λ):

    θ ← θ · (1 − η λ)                                  decoupled weight decay
    m ← m + (1 − β1) (g − m)                           = β1 m + (1 − β1) g   (a lerp)
    v ← β2 v + (1 − β2) g²
    θ ← θ − η / (1 − β1^t) · m / (√v / √(1 − β2^t) + ε)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

# torch's AdamW param-group keys beyond the hyperparameters, as its state_dict writes them
TORCH_GROUP_FLAGS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                     "differentiable": False, "fused": None, "decoupled_weight_decay": True}


def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, step: float, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: float) -> None:
    """One AdamW update in place at step ``step`` (from 1):
    θ ← θ(1 − ηλ);  m ← lerp(m, g, 1 − β1);  v ← β2 v + (1 − β2) g²;
    θ ← θ − η/(1 − β1^t) · m / (√v / √(1 − β2^t) + ε)."""
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))


def _check_hyperparameters(lr: float, betas: tuple[float, float], eps: float,
                           weight_decay: float) -> None:
    """torch.optim.AdamW's checks and messages: lr, eps, weight_decay >= 0 and 0 <= beta < 1
    (beta = 1 makes a bias correction 1 - beta^t zero: NaN weights for beta2, a
    ZeroDivisionError for beta1)."""
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    for index, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


class AdamW:
    """The optimizer surface the trainers use: ``param_groups`` (``lr`` settable), ``state``
    (per parameter: ``step``, ``exp_avg``, ``exp_avg_sq``), ``step``, ``zero_grad``,
    ``state_dict`` and ``load_state_dict`` in torch's format."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        _check_hyperparameters(lr, betas, eps, weight_decay)
        self.defaults = {"lr": lr, "betas": tuple(betas), "eps": eps,
                         "weight_decay": weight_decay, **TORCH_GROUP_FLAGS}
        self.param_groups: list[dict[str, Any]] = [{**self.defaults, "params": list(params)}]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state.get(param)
                if state is None:
                    state = self.state[param] = {
                        "step": torch.zeros((), dtype=torch.float32),
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}
                state["step"] += 1
                adamw_update(param, param.grad, state["exp_avg"], state["exp_avg_sq"],
                             state["step"].item(), group["lr"], beta1, beta2, group["eps"],
                             group["weight_decay"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()

    def _indexed(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: parameters as their position over the groups, state by position."""
        position = {id(p): i for i, p in enumerate(self._indexed())}
        groups, start = [], 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(packed)
        return {"state": {position[id(p)]: s for p, s in self.state.items()},
                "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A torch (or this class's) AdamW state: hyperparameters from the saved groups, moments
        cast to each parameter's dtype and device (``step`` stays a CPU scalar, as in torch)."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("loaded optimizer state has param groups of other sizes than this "
                             "optimizer's (a checkpoint of another model?)")
        params = self._indexed()
        self.param_groups = [{**{k: v for k, v in s.items() if k != "params"},
                              "params": g["params"]} for s, g in zip(saved, self.param_groups, strict=True)]
        self.state = {}
        for index, values in state_dict["state"].items():
            param = params[int(index)]
            self.state[param] = {k: v if k == "step" else v.to(dtype=param.dtype,
                                                                 device=param.device)
                                 for k, v in values.items()}


Optimizer = AdamW | torch.optim.Optimizer


def make_adamw(params: Iterable[torch.Tensor], lr: float, weight_decay: float,
               betas: tuple[float, float], device: str) -> Optimizer:
    """The trainers' AdamW: this module's on CPU (no ``torch._dynamo`` import), torch's fused
    kernel on CUDA."""
    if device == "cuda":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas,
                                 fused=True)
    return AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)
