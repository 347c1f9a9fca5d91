"""The PPO critic: a separate value model, V(s_t) for every response token.

Design: a copy of the policy's transformer backbone (``policy.base_model``, e.g. Qwen2Model)
with a scalar head ``Linear(hidden_size, 1)``, initialised from the policy when PPO training
starts (the weights at that point, normally version 0) and trained by its own AdamW on the
clipped value loss. It shares no parameters with the policy, so the actor's and the critic's
updates never interfere (as slime's separate critic model).

V_t is read at the position whose hidden state predicts response token t, i.e. the value of the
state (prompt, y_<t) before the action y_t.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from infra.modeling import base_model_from_config
from trainers.adamw import Optimizer, make_adamw
from trainers.base import PaddedBatch
from trainers.shared_prompt import response_hidden

CRITIC_FILE = "critic.pt"


class ValueModel(torch.nn.Module):
    """backbone (HF base model) + value head; ``response_values`` reads V at the response
    positions (the head on the backbone's hidden states there)."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_policy(cls, policy: torch.nn.Module) -> ValueModel:
        """A copy of ``policy``'s backbone (its current weights) + a zero-initialised head
        (so V = 0 everywhere at the start: the first advantages are the plain returns)."""
        backbone = copy.deepcopy(policy.base_model)
        for p in backbone.parameters():
            p.requires_grad_(True)
        device = next(backbone.parameters()).device
        return cls(backbone, policy.config.hidden_size).to(device).train()

    @classmethod
    def from_config(cls, config, device: str = "cpu") -> ValueModel:
        """An untrained fp32 value model of ``config``'s shape on ``device`` (``load_critic``
        fills it)."""
        return cls(base_model_from_config(config, device), config.hidden_size).to(device).train()


def response_values(critic: ValueModel, pb: PaddedBatch, share_prompt: bool = False
                    ) -> torch.Tensor:
    """V[b, t] = critic(x)[b, response_index[b, t]] -> [B, T]: the value head on the hidden
    states predicting the response tokens (each prompt run once with ``share_prompt``:
    ``trainers.shared_prompt``)."""
    hidden = response_hidden(critic.backbone, pb, share_prompt)
    return critic.value_head(hidden.float()).squeeze(-1)


def make_critic_optimizer(critic: ValueModel, lr: float, weight_decay: float,
                          betas: tuple[float, float]) -> Optimizer:
    device = "cuda" if next(critic.parameters()).is_cuda else "cpu"
    return make_adamw(critic.parameters(), lr, weight_decay, betas, device)


def critic_state(critic: ValueModel, optimizer: Optimizer) -> dict:
    """The critic's weights and its optimizer state, saved in one file (``CRITIC_FILE``) next to
    the policy (live tensors: the checkpoint writer copies them)."""
    return {"model": critic.state_dict(), "optimizer": optimizer.state_dict()}


def load_critic(path: Path, config, lr: float, weight_decay: float, betas: tuple[float, float],
                device: str = "cpu") -> tuple[ValueModel, Optimizer]:
    """Rebuild what ``critic_state`` saved (``config``: the policy's HF config) on ``device``."""
    state = torch.load(path, weights_only=False, map_location=device)
    critic = ValueModel.from_config(config, device)
    critic.load_state_dict(state["model"])
    optimizer = make_critic_optimizer(critic, lr, weight_decay, betas)
    optimizer.load_state_dict(state["optimizer"])
    return critic, optimizer
