"""What a rollout function sees: ``RolloutContext`` (slime passes ``args`` + a data buffer).

A custom ``rollout_function_path`` draws prompts with ``ctx.take_groups(n)``, which advances the
durable data position; it generates with ``ctx.generate(samples)`` (the engine, or the custom
generate function) and scores with ``ctx.score(samples)``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rewards.registry import check_set_rewards, score_samples
from rollout.data import PromptDataset
from rollout.engine import RolloutEngine, SamplingParams
from rollout.functions import call_named
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
    groups_taken: int = 0  # by ``take_groups``, for its numbering
    samples_taken: int = 0
    chunk_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def take_groups(self, n: int) -> list[list[Sample]]:
        """The next ``n`` prompts as groups of ``n_samples_per_prompt`` pending samples, numbered
        on from the context's previous draws (group_index and index): a rollout function that
        draws twice returns samples whose indexes, which key their rows, differ (each draw
        numbered from 0, and the second draw's rows were refused as duplicates)."""
        r = self.cfg.rollout
        prompts = self.dataset.take(self.data_position, n)
        self.data_position += n
        samples = make_samples(prompts, self.tokenizer, r.n_samples_per_prompt, self.dataset.source,
                               first_group=self.groups_taken, first_index=self.samples_taken,
                               apply_chat_template=self.cfg.data.apply_chat_template)
        self.groups_taken += len(prompts)
        self.samples_taken += len(samples)
        return group_samples(samples)

    def generate(self, samples: list[Sample]) -> list[Sample]:
        """One generation step of every pending sample: the custom generate function (whole
        samples, one by one) or the engine (batched, ``chunk_tokens`` at a time)."""
        if self.generate_fn is None:
            return generate_samples(self.engine, self.tokenizer, samples, self.sampling, self.chunk_tokens)
        version = getattr(self.engine, "weight_version", None)
        label, vocab = generate_label(self.cfg), self.vocab_size()
        for s in samples:
            if s.status == Status.PENDING:
                if version is not None:  # the weights it generates with (the function may say)
                    s.weight_version = version
                out = call_named(label, self.generate_fn, self, s, self.sampling)
                if not isinstance(out, Sample):
                    raise TypeError(f"{label} returned {type(out).__name__}, expected a Sample")
                if out is not s:  # in place: callers hold the sample in their groups
                    s.__dict__.update(out.__dict__)
                check_generated(s, self.sampling.max_new_tokens, vocab, label)
        return samples

    def score(self, samples: list[Sample]) -> int:
        """Score the samples that have no reward yet, check the others' (``score_unscored``);
        returns the number that failed."""
        return score_unscored(samples, self.scorer)

    def vocab_size(self) -> int | None:
        """How many token ids the model has (``model_vocab_size``)."""
        return model_vocab_size(self.engine, self.cfg, self.tokenizer)


GENERATE_KEY = "custom_generate_function_path"


def generate_label(cfg) -> str:
    """The custom generate function in errors: its config key and path (just the key when the
    function was set on the context without a configured path)."""
    path = cfg.rollout.custom_generate_function_path
    return f"rollout.{GENERATE_KEY} '{path}'" if path else GENERATE_KEY


def model_vocab_size(engine: Any, cfg: Any, tokenizer: Any) -> int | None:
    """How many token ids the model has (its embedding's rows; an id at or past it failed in
    training as "index out of range in self"): the in-process engine's model config, else the
    model folder's ``config.json`` (SGLang: the model lives in its servers), else the tokenizer's
    length (the tiny model is built with ``vocab_size = len(tokenizer)``). The model's, not the
    tokenizer's: a model's vocabulary may be padded past the tokenizer (Qwen2.5: 151936 rows,
    151665 tokens) and an engine may sample a padded id, which trains fine. None: unknown."""
    size = getattr(getattr(getattr(engine, "model", None), "config", None), "vocab_size", None)
    if size is None and cfg is not None and cfg.model.path:
        config = Path(cfg.model.path) / "config.json"
        if config.exists():
            size = json.loads(config.read_text()).get("vocab_size")
    if size is None and tokenizer is not None:
        size = len(tokenizer)
    return int(size) if size is not None else None


def check_generated(sample: Sample, max_new_tokens: int, vocab_size: int | None = None,
                    label: str = GENERATE_KEY) -> None:
    """What a custom generate function must give back (docs/rollout.md): a status other than
    pending, and what ``check_samples`` checks, ``rollout_log_probs`` and ``loss_mask`` set
    (``complete``). Each was taken as it came: a mask longer than the response was trained on,
    empty log-probs read as a train/rollout log-prob difference of 0 (review, 2026-11-29)."""
    if sample.status == Status.PENDING:
        raise ValueError(f"{label} returned a sample still 'pending': set its status (completed, "
                         "truncated, aborted)")
    check_samples([sample], f"{label} returned", max_new_tokens, vocab_size, complete=True)


# how far above 0 a reported log-prob may be: an engine computing in bf16/fp16 can round a
# near-certain token's log-prob a hair above 0, which is no reason to refuse the iteration
LOGPROB_SLACK = 1e-3


def sample_problem(sample: Sample, max_len: int, vocab_size: int | None, complete: bool) -> str | None:
    """What is wrong with a generated sample's tokens, or None: token ids (prompt and response)
    in [0, ``vocab_size``), at most ``max_len`` response tokens, one ``loss_mask`` entry (0 or 1)
    and one rollout log-prob (finite, <= 0) per response token. Without ``complete`` an empty
    mask (every token trained) or empty log-probs (none reported) is allowed, as the trainer
    reads them. Each of these went into the lake unchecked and failed training, on every resume
    too, as the rows were reused (review, 2026-11-29)."""
    n = len(sample.response_token_ids)
    if n > max_len:
        return (f"{n} response tokens, over the budget of {max_len} (the whole response's: "
                "sampling.max_new_tokens, rollout.rollout_max_response_len in a run)")
    for part, ids in (("prompt", sample.prompt_token_ids), ("response", sample.response_token_ids)):
        if not ids:
            continue
        low, high = min(ids), max(ids)  # C loops: a long response costs no Python loop
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            bad = low if low < 0 else high
            return f"{part} token id {bad}, outside the model's vocabulary [0, {vocab_size})"
    for name in ("loss_mask", "rollout_log_probs"):
        have = len(getattr(sample, name))
        if have != n and (complete or have):
            return (f"{have} {name} for {n} response tokens: one per response token"
                    + ("" if complete else " (or none)"))
    if any(m not in (0, 1) for m in sample.loss_mask):
        return f"loss_mask values {sorted(set(sample.loss_mask) - {0, 1})[:3]}: each must be 0 or 1"
    bad_lp = [x for x in sample.rollout_log_probs if not (math.isfinite(x) and x <= LOGPROB_SLACK)]
    if bad_lp:
        return (f"rollout log-prob {bad_lp[0]} ({len(bad_lp)} such): a log-probability is a "
                "finite number <= 0")
    return None


def check_samples(samples: Iterable[Sample], where: str, max_len: int, vocab_size: int | None,
                  complete: bool = False) -> None:
    """Raise ValueError at the first sample with a ``sample_problem``, naming it and ``where``
    ("KEY 'path' returned"): the one check for what a rollout, generate or eval function gives
    back, before any of it reaches the lake."""
    for s in samples:
        problem = sample_problem(s, max_len, vocab_size, complete)
        if problem:
            raise ValueError(f"{where} a sample (group_index {s.group_index}, index {s.index}) "
                             f"with {problem}")


def refuse_pending(groups: list[list[Sample]], where: str) -> None:
    """Raise ValueError when a returned sample is still 'pending' (never generated), naming
    ``where`` ("KEY 'path' returned")."""
    pending = sum(s.status == Status.PENDING for g in groups for s in g)
    if pending:
        total = sum(len(g) for g in groups)
        raise ValueError(f"{where} {pending} of {total} samples still 'pending' (never generated): "
                         "generate them with ctx.generate(samples) before returning them")


def check_indexes(kinds: Iterable[tuple[str, list[list[Sample]]]], where: str) -> None:
    """Raise ValueError unless, within each kind (train groups, filtered, aborted), every
    sample's ``index`` is unique and every group's samples share a ``group_index`` no other
    group has. The index is the row's key (``sample_uid`` = run/iteration/index): 256 samples
    all of index 0 became one row in the lake, and training (which groups rows by
    ``group_index``) failed on group sizes, on every resume too (review, 2026-11-29)."""
    for kind, groups in kinds:
        seen: dict[int, int] = {}  # index -> group_index
        owner: dict[int, int] = {}  # group_index -> position of its group in the list
        for pos, group in enumerate(groups):
            for s in group:
                if s.index in seen:
                    raise ValueError(
                        f"{where} two {kind} samples of index {s.index} (group_index "
                        f"{seen[s.index]} and {s.group_index}): a sample's index keys its row "
                        "(run/iteration/index) and must be unique in the iteration; return a "
                        "list of groups (rlake numbers them) or renumber them "
                        "(rollout.context.renumber)")
                seen[s.index] = s.group_index
                if owner.setdefault(s.group_index, pos) != pos:
                    raise ValueError(
                        f"{where} {kind} samples of group_index {s.group_index} in two groups "
                        f"(groups {owner[s.group_index]} and {pos}): a group's samples share one "
                        "group_index, which no other group has (training groups rows by it)")


def score_unscored(samples: list[Sample], scorer: Callable) -> int:
    """Score the samples without a reward with ``scorer``; a reward set already (a rollout
    function may set its own) gets the check a scored one gets: a non-finite (or non-numeric)
    one marks its sample failed with the reason, reward 0. Unchecked, NaN and inf rewards were
    written as completed and failed the run (review, 2026-11-29). Returns how many failed."""
    failed = check_set_rewards([s for s in samples if s.reward is not None])
    todo = [s for s in samples if s.reward is None]
    return failed + (score_samples(todo, scorer) if todo else 0)


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
