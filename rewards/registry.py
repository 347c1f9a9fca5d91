"""The reward registry: ``rm_type`` (or a custom function) -> a score for each sample.

Built-in reward functions take ``(response: str, label: str | None, metadata: dict)`` and return
a float (or a dict with a ``"score"`` key). ``rm_type`` names one of ``REGISTRY``, ``remote``
(HTTP POST to ``rm_url``), or ``boxed_<name>`` (score only the last ``\\boxed{}`` of the response
with ``<name>``; no box scores 0). A sample's ``metadata["rm_type"]`` overrides the configured one;
``custom_rm_path`` (``fn(cfg, sample)``, slime's shape) replaces the registry for the others.

``score_samples`` scores a batch concurrently; a function that raises, times out or returns NaN/inf
marks that sample ``failed`` with the reason in ``reward_detail["error"]``. A ``custom_rm_path``
function runs in worker processes (``rewards.workers``: a call past ``reward_timeout_s`` is killed
with its worker); the built-in rewards are bounded-time code of ours (no exponents, inputs capped
in length), so they run inline, one after another (256 ``addition`` samples: 0.15 ms inline,
~10 ms handed to threads); the remote one has its own HTTP timeout and runs in threads, which
wait on the network together; a function added with ``register`` runs in threads too, under
``reward_timeout_s``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from rewards.concurrent import Outcome, run_call, run_concurrently
from rewards.math import last_boxed, math_reward
from rewards.remote import remote_reward
from rewards.tasks import countdown_reward
from rewards.text import exact_answer_reward, f1_score
from rewards.workers import RewardWorkers
from rollout.functions import call, load_configured, load_function
from rollout.sample import Sample, Status, detail_json, nonfinite_reason

RewardFn = Callable[[str, "str | None", dict], "float | dict"]
SampleScorer = Callable[[Sample], "float | dict"]

__all__ = ["REGISTRY", "RewardFn", "Scorer", "get_reward_fn", "load_function", "register",
           "resolve_rm_type", "score_samples"]


def _exact(response: str, label: str | None, metadata: dict) -> float:
    return exact_answer_reward(response, label or "")


def _f1(response: str, label: str | None, metadata: dict) -> float:
    return f1_score(response, label or "")


REGISTRY: dict[str, RewardFn] = {
    "exact": _exact,
    "addition": _exact,
    "countdown": countdown_reward,
    "math": math_reward,
    "f1": _f1,
}


# ours, bounded in time: run inline (a name re-registered with another function is not)
BOUNDED: dict[str, RewardFn] = dict(REGISTRY)


def register(name: str, fn: RewardFn) -> None:
    REGISTRY[name] = fn


def bounded(rm_type: str) -> bool:
    """Whether ``rm_type`` is one of our built-in rewards (``boxed_`` of one included)."""
    name = rm_type
    while name.startswith("boxed_"):
        name = name.removeprefix("boxed_")
    return name in BOUNDED and REGISTRY.get(name) is BOUNDED[name]


def _boxed(inner: RewardFn, response: str, label: str | None, metadata: dict) -> float | dict:
    boxed = last_boxed(response)
    return 0.0 if boxed is None else inner(boxed, label, metadata)


def resolve_rm_type(rm_type: str, rm_url: str | None = None, timeout_s: float = 10.0,
                    retries: int = 2) -> Callable[[Sample], float | dict]:
    """A per-sample scorer for ``rm_type``; a clear error for an unknown name."""
    if rm_type.startswith("boxed_"):
        inner = resolve_rm_type(rm_type.removeprefix("boxed_"), rm_url, timeout_s, retries)

        def boxed(sample: Sample) -> float | dict:
            box = last_boxed(sample.response)
            return 0.0 if box is None else inner(replace(sample, response=box))
        return boxed
    if rm_type == "remote":
        if not rm_url:
            raise ValueError("rm_type 'remote' needs rollout.rm_url")
        return lambda s: remote_reward(rm_url, s.prompt if isinstance(s.prompt, str) else str(s.prompt),
                                       s.response, s.label, s.metadata, timeout_s, retries)
    if rm_type not in REGISTRY:
        raise ValueError(f"unknown rm_type '{rm_type}'; known: {sorted(REGISTRY)}, 'remote', "
                         "'boxed_<name>' (or set custom_rm_path)")
    fn = REGISTRY[rm_type]
    return lambda s: fn(s.response, s.label, s.metadata)


def get_reward_fn(rm_type: str, custom_rm_path: str | None = None) -> RewardFn:
    """A ``(response, label, metadata)`` reward function (kept for simple callers)."""
    if custom_rm_path:
        return load_function(custom_rm_path, 3, "custom_rm_path")
    if rm_type.startswith("boxed_"):
        return partial(_boxed, get_reward_fn(rm_type.removeprefix("boxed_")))
    if rm_type not in REGISTRY:
        raise ValueError(f"unknown rm_type '{rm_type}'; known: {sorted(REGISTRY)}")
    return REGISTRY[rm_type]


# One pool per (function, cfg, size) in this process, not one per Scorer: the train reward and
# every eval set's Scorer (rollout/evaluation.py builds them from the config alone) call the same
# function with the same cfg, and separate pools kept 8 idle processes each for the whole run
# (3 eval sets: 32 workers, ~7 GB, on 2 cores). Kept here, where Scorers are built, so no caller
# has to pass a pool along. Keyed by the cfg's identity (the workers get that cfg; the pool holds
# it, so the id is not reused while the entry lives); the time limit is per call, not per pool.
_POOLS: dict[tuple[str, int, int], RewardWorkers] = {}


def shared_workers(path: str, cfg: Any, size: int) -> RewardWorkers:
    """The process's pool for ``path`` called with ``cfg`` by at most ``size`` workers."""
    key = (path, id(cfg), size)
    if key not in _POOLS:
        _POOLS[key] = RewardWorkers(path, cfg, size)
    return _POOLS[key]


def release_workers(workers: RewardWorkers) -> None:
    """Stop a pool's processes and forget it: a Scorer built later gets a fresh pool."""
    for key in [k for k, pool in _POOLS.items() if pool is workers]:
        del _POOLS[key]
    workers.close()


@dataclass
class Scorer:
    """Scores one sample: ``metadata["rm_type"]`` if set, else ``custom_rm_path``, else
    ``rm_type``. Resolving happens at construction (bad names fail before any generation)."""

    rm_type: str = "exact"
    custom_rm_path: str | None = None
    rm_url: str | None = None
    cfg: Any = None
    remote_timeout_s: float = 10.0
    remote_retries: int = 2
    timeout_s: float = 30.0
    max_workers: int = 8

    def __post_init__(self) -> None:
        self._custom = load_configured("custom_rm_path", self.custom_rm_path)
        self._cache: dict[str, Callable[[Sample], float | dict]] = {}
        if self._custom is None:
            self._resolve(self.rm_type)
        self.workers = (shared_workers(self.custom_rm_path, self.cfg, self.max_workers)
                        if self._custom is not None else None)

    def in_worker(self, sample: Sample) -> bool:
        """Whether ``sample`` goes to the custom function (in a worker process)."""
        return self.workers is not None and not sample.metadata.get("rm_type")

    def inline(self, sample: Sample) -> bool:
        """Whether ``sample``'s reward is a built-in one (``bounded``): scored in this thread."""
        override = sample.metadata.get("rm_type")
        if override:
            return bounded(str(override))
        return self._custom is None and bounded(self.rm_type)

    def outcomes(self, samples: list[Sample], timeout_s: float, max_workers: int) -> list[Outcome]:
        """One ``Outcome`` per sample: custom-function calls in worker processes, built-in
        rewards inline, the rest (remote, registered) in threads."""
        route = ["far" if self.in_worker(s) else "here" if self.inline(s) else "near"
                 for s in samples]
        far, here, near = ([i for i, r in enumerate(route) if r == where]
                           for where in ("far", "here", "near"))
        out: list[Outcome] = [Outcome(False, error="not run")] * len(samples)
        for i in here:
            out[i] = run_call(partial(self, samples[i]))
        for i, o in zip(near, run_concurrently([partial(self, samples[i]) for i in near], timeout_s,
                                               max_workers), strict=True):
            out[i] = o
        if far:
            for i, o in zip(far, self.workers.map([samples[i] for i in far], timeout_s), strict=True):
                out[i] = o
        return out

    def close(self) -> None:
        """Stop the reward worker processes, shared with the run's other scorers (a later call
        starts new ones; closing the others too, as the run's close does, is a no-op)."""
        if self.workers is not None:
            release_workers(self.workers)

    @classmethod
    def from_config(cls, cfg: Any, rm_type: str | None = None) -> Scorer:
        r = cfg.rollout
        return cls(rm_type=rm_type or r.rm_type, custom_rm_path=r.custom_rm_path, rm_url=r.rm_url,
                   cfg=cfg, remote_timeout_s=r.rm_timeout_s, remote_retries=r.rm_retries,
                   timeout_s=r.reward_timeout_s, max_workers=r.reward_max_workers)

    def _resolve(self, rm_type: str) -> Callable[[Sample], float | dict]:
        if rm_type not in self._cache:
            self._cache[rm_type] = resolve_rm_type(rm_type, self.rm_url, self.remote_timeout_s,
                                                   self.remote_retries)
        return self._cache[rm_type]

    def __call__(self, sample: Sample) -> float | dict:
        override = sample.metadata.get("rm_type")
        if override:
            return self._resolve(str(override))(sample)
        if self._custom is not None:
            return call(self._custom, self.cfg, sample)
        return self._resolve(self.rm_type)(sample)


def _as_score(value: float | dict) -> tuple[float, dict]:
    """(score, detail): a dict's ``score`` key, or the float itself; NaN and +-inf are errors
    (one inf reward makes every mean/std over the batch inf or NaN)."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError("reward dict has no 'score' key")
        score, detail = float(value["score"]), dict(value)
        try:  # here, not at the lake append: one odd dict crashed the whole run there
            detail_json(detail)
        except (TypeError, ValueError, RecursionError) as err:
            raise ValueError(f"reward dict cannot be stored as JSON ({err})") from None
    else:
        score, detail = float(value), {}
    if not math.isfinite(score):
        raise ValueError(nonfinite_reason(score))
    return score, detail


def score_samples(samples: list[Sample], scorer: SampleScorer | RewardFn, timeout_s: float | None = None,
                  max_workers: int | None = None) -> int:
    """Set ``reward``/``reward_detail`` (and ``status = failed`` on error) in place.

    ``scorer`` is a per-sample callable (a ``Scorer``) or a plain ``(response, label, metadata)``
    reward function. Returns the number of failed samples. A failed sample's reward is 0.0 so its
    group still trains; the reason is kept in ``reward_detail["error"]``.
    """
    timeout_s = timeout_s if timeout_s is not None else getattr(scorer, "timeout_s", 30.0)
    max_workers = max_workers if max_workers is not None else getattr(scorer, "max_workers", 8)
    if isinstance(scorer, Scorer):
        outcomes = scorer.outcomes(samples, timeout_s, max_workers)
    else:
        outcomes = run_concurrently([partial(scorer, s.response, s.label, s.metadata)
                                     for s in samples], timeout_s, max_workers)
    failures = 0
    for sample, outcome in zip(samples, outcomes, strict=True):
        try:
            if not outcome.ok:
                raise RuntimeError(outcome.error)
            sample.reward, sample.reward_detail = _as_score(outcome.value)
        except Exception as err:  # noqa: BLE001 - any user error marks the sample failed
            failures += 1
            _fail(sample, str(err) if isinstance(err, RuntimeError) else f"{type(err).__name__}: {err}")
    return failures


def _fail(sample: Sample, reason: str) -> None:
    sample.reward = 0.0
    sample.reward_detail = {"error": reason}
    sample.status = Status.FAILED
