"""The frozen reference policy for KL (``use_kl_loss`` or ``kl_coef``), loaded only when needed.

The reference is the policy at weight version 0 (the base model, or the SFT warm-up's output):
the runtime passes the folder of checkpoint v0, or ``trainer.ref_load`` names another HF folder.
It is re-loaded from that folder after a resume, never saved with the trainer's checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import torch

from infra.modeling import load_model


def load_reference(path: str | Path, device: str = "cpu", dtype: str = "fp32") -> torch.nn.Module:
    """An HF causal LM from ``path``, in eval mode, with every parameter frozen; its weights
    are stored in ``dtype`` on ``device`` (it never trains: no fp32 master copy needed)."""
    if not (Path(path) / "config.json").exists():
        raise FileNotFoundError(f"reference model folder '{path}' is not an HF model folder "
                                f"(no config.json); set trainer.ref_load to one")
    model = load_model(path, device, dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def needs_reference(use_kl_loss: bool, kl_coef: float, advantage_estimator: str) -> bool:
    """A reference is needed for KL in the loss, or for KL in the reward (kl_coef > 0 with an
    estimator that uses it: ppo, reinforce_plus_plus, reinforce_plus_plus_baseline)."""
    reward_kl = kl_coef > 0 and advantage_estimator not in ("grpo", "gspo")
    return use_kl_loss or reward_kl
