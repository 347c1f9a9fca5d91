"""One iteration's rollout from config: pick the rollout function, the filter, the generator.

``rollout_function_path`` replaces ``default_rollout`` entirely (it may return groups or a
``RolloutOutput``). The dynamic sampling filter is ``dynamic_sampling_filter_path`` when set
(``default`` names ``check_reward_nonzero_std``), the default filter when only
``over_sampling_batch_size`` is set, and none otherwise. Every function is resolved here, when the
runtime opens, before any generation.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout.context import (
    RolloutContext,
    RolloutOutput,
    check_indexes,
    check_samples,
    checked_groups,
    refuse_pending,
    renumber,
)
from rollout.dynamic import default_rollout, filter_label
from rollout.filters import check_reward_nonzero_std
from rollout.functions import call_named, load_configured
from rollout.sample import Sample

ROLLOUT_KEY = "rollout.rollout_function_path"


def resolve_filter(cfg) -> Callable[[list[Sample]], bool] | None:
    r = cfg.rollout
    path = r.dynamic_sampling_filter_path
    if path == "default" or (path is None and r.over_sampling_batch_size is not None):
        fn = check_reward_nonzero_std
    elif path is None:
        return None
    else:
        fn = load_configured("dynamic_sampling_filter_path", path)
    return named_filter(fn, cfg)


def named_filter(fn: Callable, cfg) -> Callable[[list[Sample]], bool]:
    """``fn`` as the rollout calls it: an error it raises names the config key and the function
    (a bare "boom in filter" did not say which user function failed; review, 2026-11-29)."""
    label = filter_label(cfg)

    def keep(group: list[Sample]) -> bool:
        return bool(call_named(label, fn, cfg, group))

    return keep


def rollout_groups(out: object, path: str, n_samples_per_prompt: int) -> list[list[Sample]]:
    """The groups a ``rollout_function_path`` function returned (a RolloutOutput's, or a list
    of groups), checked (``checked_groups``), each of ``n_samples_per_prompt`` generated
    samples: never-generated samples were committed as train rows, and uneven groups were
    trained as groups of n across prompts (review, 2026-11-29)."""
    where = f"{ROLLOUT_KEY} '{path}' returned"
    groups = checked_groups(out.groups if isinstance(out, RolloutOutput) else out, where,
                            "expected a RolloutOutput or a list of groups (lists of Sample)")
    if not all(groups):
        raise ValueError(f"{where} an empty group: expected at least one group of at least one Sample")
    uneven = [(i, len(g)) for i, g in enumerate(groups) if len(g) != n_samples_per_prompt]
    if uneven:
        i, size = uneven[0]
        raise ValueError(f"{where} a group of {size} samples (group {i}, {len(uneven)} uneven in all): "
                         f"every group holds rollout.n_samples_per_prompt = {n_samples_per_prompt} "
                         "samples (advantages are normalised within a group)")
    refuse_pending(groups, where)
    return groups


class Rollout:
    """Resolved rollout functions for a run; ``__call__(ctx, iteration) -> RolloutOutput``."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.rollout_fn = load_configured("rollout_function_path", cfg.rollout.rollout_function_path)
        self.generate_fn = load_configured("custom_generate_function_path",
                                           cfg.rollout.custom_generate_function_path)
        self.keep = resolve_filter(cfg)

    def __call__(self, ctx: RolloutContext, iteration: int) -> RolloutOutput:
        ctx.generate_fn = self.generate_fn
        ctx.chunk_tokens = self.cfg.rollout.generation_chunk_tokens
        if self.rollout_fn is None:
            return default_rollout(ctx, iteration, keep=self.keep)
        start = ctx.data_position
        path = self.cfg.rollout.rollout_function_path
        out = call_named(f"{ROLLOUT_KEY} '{path}'", self.rollout_fn, ctx, iteration)
        groups = rollout_groups(out, path, self.cfg.rollout.n_samples_per_prompt)
        checked_samples(out, groups, ctx, f"{ROLLOUT_KEY} '{path}' returned")
        if not isinstance(out, RolloutOutput):
            out = RolloutOutput(groups=renumber(groups))
        out.stats.setdefault("rollout/prompts_drawn", float(ctx.data_position - start))
        out.stats["rollout/data_position_end"] = float(ctx.data_position)
        return out


def checked_samples(out: object, groups: list[list[Sample]], ctx: RolloutContext, where: str) -> None:
    """Every sample a rollout function returned (its filtered and aborted ones too: they are
    rows as well), checked before anything of the iteration is written: tokens, mask, log-probs
    and length (``check_samples``, against the rollout's budget ``ctx.sampling.max_new_tokens``,
    rollout_max_response_len), and, for a RolloutOutput, whose indexes rlake keeps, unique
    indexes (``check_indexes``; a list of groups is renumbered)."""
    kinds = [("train", groups)]
    if isinstance(out, RolloutOutput):
        kinds += [("filtered", out.filtered), ("aborted", out.aborted)]
        check_indexes(kinds, where)
    check_samples((s for _, gs in kinds for g in gs for s in g), where, ctx.sampling.max_new_tokens,
                  ctx.vocab_size())
