"""What a rollout function sees: ``RolloutContext`` (slime passes ``args`` + a data buffer).

A custom ``rollout_function_path`` draws prompts with ``ctx.take_groups(n)``, which advances the
durable data position; it generates with ``ctx.generate(samples)`` (the engine, or the custom
generate function) and scores with ``ctx.score(samples)``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rewards.registry import score_samples
from rollout.data import PromptDataset
from rollout.engine import RolloutEngine, SamplingParams
from rollout.functions import call
from rollout.rollout import generate_samples, make_samples
from rollout.sample import Sample, Status


@dataclass
class RolloutOutput:
    """One iteration's rollout: ``groups`` are trained on; ``filtered`` (rejected by the dynamic
    sampling filter) and ``aborted`` (stopped once enough groups were kept) are recorded in the
    lake under kind ``filtered`` / ``aborted`` / ``partial`` (aborted, to be continued)."""

    groups: list[list[Sample]]
    filtered: list[list[Sample]] = field(default_factory=list)
    aborted: list[list[Sample]] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g]

    def rows(self, run_id: str, iteration: int, engine: str, partial_rollout: bool) -> list[dict]:
        """Every sample as a ``trajectories`` row: kinds train / filtered / partial or aborted."""
        kinds = (("train", self.groups), ("filtered", self.filtered),
                 ("partial" if partial_rollout else "aborted", self.aborted))
        return [s.to_row(run_id, iteration, engine, kind)
                for kind, groups in kinds for g in groups for s in g]

    def commit_info(self) -> dict[str, str]:
        """What goes into the rows' Delta commit: the stats (``rollout/data_position_end``
        among them), so that a resume reusing the rows advances the data position exactly."""
        return {ROLLOUT_STATS_KEY: json.dumps(self.stats)}


ROLLOUT_STATS_KEY = "rlake.rollout_stats"


def rollout_stats_from_commit(info: dict | None) -> dict[str, float] | None:
    """The stats ``RolloutOutput.commit_info`` stored, or None (rows written without them)."""
    if not info or ROLLOUT_STATS_KEY not in info:
        return None
    return {k: float(v) for k, v in json.loads(info[ROLLOUT_STATS_KEY]).items()}


@dataclass
class RolloutContext:
    cfg: Any  # infra.config.RunConfig (rlake's "args")
    engine: RolloutEngine
    tokenizer: Any
    dataset: PromptDataset
    scorer: Callable
    sampling: SamplingParams
    data_position: int = 0
    lake: Any = None
    run_id: str | None = None
    generate_fn: Callable | None = None
    chunk_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def take_groups(self, n: int) -> list[list[Sample]]:
        """The next ``n`` prompts as groups of ``n_samples_per_prompt`` pending samples."""
        r = self.cfg.rollout
        prompts = self.dataset.take(self.data_position, n)
        self.data_position += n
        samples = make_samples(prompts, self.tokenizer, r.n_samples_per_prompt, self.dataset.source,
                               apply_chat_template=self.cfg.data.apply_chat_template)
        return group_samples(samples)

    def generate(self, samples: list[Sample]) -> list[Sample]:
        """One generation step of every pending sample: the custom generate function (whole
        samples, one by one) or the engine (batched, ``chunk_tokens`` at a time)."""
        if self.generate_fn is None:
            return generate_samples(self.engine, self.tokenizer, samples, self.sampling, self.chunk_tokens)
        version = getattr(self.engine, "weight_version", None)
        for s in samples:
            if s.status == Status.PENDING:
                if version is not None:  # the weights it generates with (the function may say)
                    s.weight_version = version
                out = call(self.generate_fn, self, s, self.sampling)
                if not isinstance(out, Sample):
                    raise TypeError(f"custom_generate_function_path returned {type(out).__name__}, "
                                    "expected a Sample")
                if out is not s:  # in place: callers hold the sample in their groups
                    s.__dict__.update(out.__dict__)
                check_generated(s, self.sampling.max_new_tokens)
        return samples

    def score(self, samples: list[Sample]) -> int:
        """Score the samples that have no reward yet; returns the number that failed."""
        todo = [s for s in samples if s.reward is None]
        return score_samples(todo, self.scorer) if todo else 0


def check_generated(sample: Sample, max_new_tokens: int) -> None:
    """What a custom generate function must give back (docs/rollout.md): a status other than
    pending, ``rollout_log_probs`` and ``loss_mask`` one per response token, a response within
    the budget. Each was taken as it came: a mask longer than the response was trained on, empty
    log-probs read as a train/rollout log-prob difference of 0 (review, 2026-11-29)."""
    key = "custom_generate_function_path"
    if sample.status == Status.PENDING:
        raise ValueError(f"{key} returned a sample still 'pending': set its status (completed, "
                         "truncated, aborted)")
    n = len(sample.response_token_ids)
    for name in ("rollout_log_probs", "loss_mask"):
        if len(getattr(sample, name)) != n:
            raise ValueError(f"{key} returned a sample with {len(getattr(sample, name))} {name} "
                             f"for {n} response tokens: one per response token")
    if n > max_new_tokens:
        raise ValueError(f"{key} returned {n} response tokens, over the budget of {max_new_tokens} "
                         "(sampling.max_new_tokens, the whole response's)")


def checked_groups(groups: object, where: str, expected: str) -> list[list[Sample]]:
    """What a user function returned as groups (``where``: "KEY 'path' returned"), checked: a
    list of lists of Sample, at least one group. Unchecked, None or a flat list failed inside
    ``list(g)`` and no groups as "division by zero" in a metric (review, 2026-11-29)."""
    if not isinstance(groups, list | tuple):
        raise TypeError(f"{where} {type(groups).__name__}: {expected}")
    for g in groups:
        if isinstance(g, Sample):
            raise TypeError(f"{where} a flat list of Sample: {expected}, one group per prompt")
        if not isinstance(g, list | tuple):
            raise TypeError(f"{where} a group of type {type(g).__name__}: {expected}")
        for s in g:
            if not isinstance(s, Sample):
                raise TypeError(f"{where} a group holding a {type(s).__name__}: {expected}")
    if not groups:
        raise ValueError(f"{where} no groups: {expected}")
    return [list(g) for g in groups]


def group_samples(samples: list[Sample]) -> list[list[Sample]]:
    """Consecutive samples sharing a group_index -> one list per group, in order."""
    groups: list[list[Sample]] = []
    for s in samples:
        if groups and groups[-1][0].group_index == s.group_index:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def renumber(groups: list[list[Sample]]) -> list[list[Sample]]:
    """group_index 0.. and index 0.. in order (sample_uid = run/iteration/index must be unique)."""
    i = 0
    for g, group in enumerate(groups):
        for s in group:
            s.group_index, s.index = g, i
            i += 1
    return groups
