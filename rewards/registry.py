"""The reward registry: ``rm_type`` (or a ``module:function`` path) -> a reward function.

A reward function takes ``(response: str, label: str | None, metadata: dict)`` and returns a
float (or a dict with a ``"score"`` key). ``score_samples`` runs it over a batch concurrently;
a function that raises, times out or returns NaN marks that sample ``failed`` with the reason.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from rewards.tasks import exact_answer_reward
from rollout.sample import Sample, Status

RewardFn = Callable[[str, "str | None", dict], "float | dict"]


def _exact(response: str, label: str | None, metadata: dict) -> float:
    return exact_answer_reward(response, label or "")


REGISTRY: dict[str, RewardFn] = {
    "exact": _exact,
    "addition": _exact,
}


def register(name: str, fn: RewardFn) -> None:
    REGISTRY[name] = fn


def load_function(path: str, n_params: int | None = None, what: str = "function") -> Callable:
    """Resolve ``package.module:function`` and check it takes ``n_params`` positional args."""
    if ":" not in path:
        raise ValueError(f"{what} '{path}' must look like 'package.module:function'")
    module_name, attr = path.split(":", 1)
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{what} '{path}' cannot be loaded: {err}") from None
    if not callable(fn):
        raise ValueError(f"{what} '{path}' is not callable")
    if n_params is not None:
        try:
            inspect.signature(fn).bind(*range(n_params))
        except TypeError:
            raise ValueError(f"{what} '{path}' must accept {n_params} positional arguments, "
                             f"its signature is {inspect.signature(fn)}") from None
    return fn


def get_reward_fn(rm_type: str, custom_rm_path: str | None = None) -> RewardFn:
    if custom_rm_path:
        return load_function(custom_rm_path, 3, "custom_rm_path")
    if rm_type not in REGISTRY:
        raise ValueError(f"unknown rm_type '{rm_type}'; known: {sorted(REGISTRY)} "
                         "(or set custom_rm_path)")
    return REGISTRY[rm_type]


def _as_score(value: float | dict) -> tuple[float, dict]:
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError("reward dict has no 'score' key")
        return float(value["score"]), value
    return float(value), {}


def score_samples(samples: list[Sample], reward_fn: RewardFn, timeout_s: float = 30.0,
                  max_workers: int = 8) -> int:
    """Set ``reward``/``reward_detail`` (and ``status = failed`` on error) in place.

    Returns the number of failed samples. A failed sample's reward is 0.0 so its group still
    trains; the reason is kept in ``reward_detail["error"]``.
    """
    failures = 0
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        futures = [pool.submit(reward_fn, s.response, s.label, s.metadata) for s in samples]
        for sample, fut in zip(samples, futures, strict=True):
            try:
                score, detail = _as_score(fut.result(timeout=timeout_s))
                if math.isnan(score):
                    raise ValueError("reward is NaN")
                sample.reward, sample.reward_detail = score, detail
            except FutureTimeout:
                failures += 1
                _fail(sample, f"reward timed out after {timeout_s}s")
            except Exception as err:  # noqa: BLE001 - any user error marks the sample failed
                failures += 1
                _fail(sample, f"{type(err).__name__}: {err}")
    return failures


def _fail(sample: Sample, reason: str) -> None:
    sample.reward = 0.0
    sample.reward_detail = {"error": reason}
    sample.status = Status.FAILED
