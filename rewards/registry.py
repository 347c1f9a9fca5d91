"""The reward registry: ``rm_type`` (or a custom function) -> a score for each sample.

Built-in reward functions take ``(response: str, label: str | None, metadata: dict)`` and return
a float (or a dict with a ``"score"`` key). ``rm_type`` names one of ``REGISTRY``, ``remote``
(HTTP POST to ``rm_url``), or ``boxed_<name>`` (score only the last ``\\boxed{}`` of the response
with ``<name>``; no box scores 0). A sample's ``metadata["rm_type"]`` overrides the configured one;
``custom_rm_path`` (``fn(cfg, sample)``, slime's shape) replaces the registry for the others.

``score_samples`` scores a batch concurrently; a function that raises, times out, returns NaN/inf,
a reward too large to train on (``MAX_ABS_REWARD``) or anything but a number (``bool`` excluded) or
a dict holding a number under ``"score"`` marks that sample ``failed`` with the reason in
``reward_detail["error"]``. The rewards that compare the response with the label
(``LABELLED``) fail a sample that has none (``check_label``). A ``custom_rm_path``
function runs in worker processes (``rewards.workers``: a call past ``reward_timeout_s`` is killed
with its worker); the built-in rewards are bounded-time code of ours (no exponents, inputs capped
in length), so they run inline, one after another (256 ``addition`` samples: 0.15 ms inline,
~10 ms handed to threads); the remote one has its own HTTP timeout and runs in threads, which
wait on the network together; a function added with ``register`` runs in threads too, under
``reward_timeout_s``.
"""

from __future__ import annotations

import numbers
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
from rollout.data import locate, short_repr
from rollout.functions import call, load_configured, load_function
from rollout.sample import (
    Sample,
    Status,
    detail_json,
    too_large_reason,
    unusable_reward_reason,
    usable_reward,
)

RewardFn = Callable[[str, "str | None", dict], "float | dict"]
SampleScorer = Callable[[Sample], "float | dict"]

__all__ = ["REGISTRY", "RewardFn", "Scorer", "get_reward_fn", "load_function", "register",
           "check_set_rewards", "resolve_rm_type", "score_samples"]


# The built-in rewards that compare the response with the label: with no label, ``label or ""``
# scored an empty response 1.0 (exact, f1), so a missing one fails the sample instead.
LABELLED = frozenset({"exact", "addition", "math", "f1"})


def missing_label(label: str | None) -> str | None:
    """Why ``label`` cannot be compared with (None or blank text), else None."""
    if label is None:
        return "the label is null (missing)"
    if not label.strip():
        return f"the label is {'empty' if not label else 'only whitespace'}"
    return None


def check_label(name: str, label: str | None) -> str:
    """``label`` if the ``name`` reward can compare with it; else a ValueError with the reason
    (the one check the label-comparing rewards share; the sample is marked failed)."""
    problem = missing_label(label)
    if problem is not None or label is None:
        raise ValueError(f"{name} reward needs a label: {problem}")
    return label


def _exact(response: str, label: str | None, metadata: dict) -> float:
    return exact_answer_reward(response, check_label("exact", label))


def _addition(response: str, label: str | None, metadata: dict) -> float:
    """``exact`` under the name the config gives it (the error names the reward it set)."""
    return exact_answer_reward(response, check_label("addition", label))


def _f1(response: str, label: str | None, metadata: dict) -> float:
    return f1_score(response, check_label("f1", label))


def _math(response: str, label: str | None, metadata: dict) -> float:
    return math_reward(response, check_label("math", label), metadata)


REGISTRY: dict[str, RewardFn] = {
    "exact": _exact,
    "addition": _addition,
    "countdown": countdown_reward,
    "math": _math,
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


def label_reward(rm_type: str | None) -> str | None:
    """The built-in reward ``rm_type`` names (``boxed_`` stripped) if it compares with the label
    (``LABELLED``, not replaced with ``register``), else None (countdown, remote, custom ones:
    whether they need a label is theirs to say)."""
    name = rm_type or ""
    while name.startswith("boxed_"):
        name = name.removeprefix("boxed_")
    return name if name in LABELLED and bounded(name) else None


def picked_reward(metadata: dict | None, rm_type: str, custom: bool) -> str | None:
    """The reward that scores a sample or prompt record (``Scorer`` picks with this): its
    ``metadata["rm_type"]``, else the custom function when there is one (None: not a name),
    else ``rm_type``."""
    override = (metadata or {}).get("rm_type")
    if override:
        return str(override)
    return None if custom else rm_type


def check_labels(records: list[dict], source: str, rm_type: str,
                 custom_rm_path: str | None = None) -> None:
    """A ValueError naming the file and line of the first record whose reward compares with the
    label (``label_reward``) but which has none: found at load, not as a failed sample at every
    iteration (``check_label`` is the backstop for data that did not come through here)."""
    for i, rec in enumerate(records):
        name = label_reward(picked_reward(rec.get("metadata"), rm_type, bool(custom_rm_path)))
        problem = missing_label(rec.get("label")) if name else None
        if problem is not None:
            raise ValueError(f"{locate(source, rec.get('row', i))}: {problem}, but its reward "
                             f"'{name}' compares the response with the label (an empty response "
                             "would match); give every row a label (data.label_key) or use a "
                             "reward that needs none")


def resolve_rm_type(rm_type: str, rm_url: str | None = None, timeout_s: float = 10.0,
                    retries: int = 2) -> Callable[[Sample], float | dict]:
    """A per-sample scorer for ``rm_type``; a clear error for an unknown name."""
    if rm_type.startswith("boxed_"):
        inner = resolve_rm_type(rm_type.removeprefix("boxed_"), rm_url, timeout_s, retries)
        labelled = label_reward(rm_type)

        def boxed(sample: Sample) -> float | dict:
            if labelled:  # before the box: no box scored 0, hiding a missing label
                check_label(labelled, sample.label)
            box = last_boxed(sample.response)
            return 0.0 if box is None else inner(replace(sample, response=box))
        return boxed
    if rm_type == "remote":
        if not rm_url:
            raise ValueError("rm_type 'remote' needs rollout.rm_url")
        # a chat goes as its list of messages (JSON), not str() of it: Python's repr,
        # "[{'role': 'user', ...}]", which the server could not parse
        return lambda s: remote_reward(rm_url, s.prompt, s.response, s.label, s.metadata,
                                       timeout_s, retries)
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
        """The run's scorer; with ``rm_type`` (an eval set's own), that reward, even where the
        run's is a ``custom_rm_path`` (which took it over: a math eval set of a run with a
        custom reward was scored by the custom one, review 2026-11-29)."""
        r = cfg.rollout
        return cls(rm_type=rm_type or r.rm_type, custom_rm_path=None if rm_type else r.custom_rm_path,
                   rm_url=r.rm_url,
                   cfg=cfg, remote_timeout_s=r.rm_timeout_s, remote_retries=r.rm_retries,
                   timeout_s=r.reward_timeout_s, max_workers=r.reward_max_workers)

    def _resolve(self, rm_type: str) -> Callable[[Sample], float | dict]:
        if rm_type not in self._cache:
            self._cache[rm_type] = resolve_rm_type(rm_type, self.rm_url, self.remote_timeout_s,
                                                   self.remote_retries)
        return self._cache[rm_type]

    def _pick(self, sample: Sample) -> str | None:
        """The reward name that scores ``sample`` (``picked_reward``); None: the custom one."""
        return picked_reward(sample.metadata, self.rm_type, self._custom is not None)

    def reward_name(self, sample: Sample) -> str:
        """The reward that scores ``sample``, for error messages."""
        name = self._pick(sample)
        return f"custom reward {self.custom_rm_path}" if name is None else _describe(name, self.rm_url)

    def __call__(self, sample: Sample) -> float | dict:
        name = self._pick(sample)
        if name is None:
            return call(self._custom, self.cfg, sample)
        return self._resolve(name)(sample)


def _describe(rm_type: str, rm_url: str | None) -> str:
    return f"remote reward {rm_url}" if rm_type == "remote" else f"reward '{rm_type}'"


_SHAPE = "return a number or {'score': number}"


def _number(value: object, who: str, in_dict: bool = False) -> float:
    """``value`` as a float if it is a real number (ints, floats, NumPy numbers; not a bool),
    finite and at most ``MAX_ABS_REWARD`` in magnitude; else a ValueError naming ``who``.
    ``float()`` of anything took "0.7" as 0.7 and True as 1, and None or a list gave
    "float() argument must be ..." naming no function."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        shown = "None" if value is None else f"{type(value).__name__} {short_repr(value)}"
        got = f"{{'score': {shown}}}" if in_dict else shown
        raise ValueError(f"{who} returned {got}: {_SHAPE}")
    try:
        score = float(value)
    except OverflowError:  # an int beyond float64 (10**400): too large, as the bound says
        raise ValueError(too_large_reason(short_repr(value))) from None
    if not usable_reward(score):
        raise ValueError(unusable_reward_reason(score))
    return score


def _as_score(value: object, who: str = "reward") -> tuple[float, dict]:
    """(score, detail): a dict's ``score`` key, or the number itself, checked by ``_number``
    (NaN and +-inf made every mean/std over the batch inf or NaN); ``who`` names the reward in
    the error. The same rule for every reward: local, custom, remote."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"{who} returned a dict without 'score' (keys: "
                             f"{short_repr(sorted(map(str, value)))}): {_SHAPE}")
        score, detail = _number(value["score"], who, in_dict=True), dict(value)
        try:  # here, not at the lake append: one odd dict crashed the whole run there
            detail_json(detail)
        except (TypeError, ValueError, RecursionError) as err:
            raise ValueError(f"reward dict cannot be stored as JSON ({err})") from None
    else:
        score, detail = _number(value, who), {}
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
            sample.reward, sample.reward_detail = _as_score(outcome.value, _who(scorer, sample))
        except Exception as err:  # noqa: BLE001 - any user error marks the sample failed
            failures += 1
            _fail(sample, str(err) if isinstance(err, RuntimeError) else f"{type(err).__name__}: {err}")
    return failures


def check_set_rewards(samples: list[Sample]) -> int:
    """The rewards already set on ``samples`` (a rollout function may set its own) checked as a
    scored one is (``_as_score``): a bad one marks its sample failed with the reason, reward 0;
    a reward dict becomes the score and its detail. Returns how many failed."""
    failures = 0
    for sample in samples:
        try:
            score, detail = _as_score(sample.reward)
        except Exception as err:  # noqa: BLE001 - any bad value fails the sample, as in scoring
            failures += 1
            _fail(sample, f"{type(err).__name__}: {err}")
            continue
        if isinstance(sample.reward, dict):  # a reward dict, as a reward function may return
            sample.reward_detail = detail
        sample.reward = score
    return failures


def _who(scorer: SampleScorer | RewardFn, sample: Sample) -> str:
    """The reward's name for an error message: a Scorer's pick for ``sample``, else the
    function's name."""
    if isinstance(scorer, Scorer):
        return scorer.reward_name(sample)
    return f"reward {getattr(scorer, '__qualname__', type(scorer).__name__)}"


def _fail(sample: Sample, reason: str) -> None:
    sample.reward = 0.0
    sample.reward_detail = {"error": reason}
    sample.status = Status.FAILED
