"""The rollout engine interface: what the torch engine and the SGLang engine both offer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings (slime: rollout_temperature, rollout_top_p, rollout_max_response_len)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass
class GenerationResult:
    """One finished generation: response token ids, their logprobs under the sampling
    distribution (log softmax of logits / temperature, as the trainer recomputes them: slime
    divides the trainer's logits by ``rollout_temperature`` too), and why it stopped:
    ``stop`` (a stop/EOS token, included in ``token_ids``), ``length`` or ``abort``."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    meta: dict = field(default_factory=dict)


@runtime_checkable
class RolloutEngine(Protocol):
    name: str

    @property
    def weight_version(self) -> int: ...

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[GenerationResult]:
        """Generate one response per prompt (prompts repeated by the caller for n samples)."""

    def update_weights(self, checkpoint_dir: str, weight_version: int) -> None:
        """Load the HF checkpoint at ``checkpoint_dir`` and serve it as ``weight_version``."""

    def shutdown(self) -> None: ...
