"""One iteration's rollout from config: pick the rollout function, the filter, the generator.

``rollout_function_path`` replaces ``default_rollout`` entirely (it may return groups or a
``RolloutOutput``). The dynamic sampling filter is ``dynamic_sampling_filter_path`` when set
(``default`` names ``check_reward_nonzero_std``), the default filter when only
``over_sampling_batch_size`` is set, and none otherwise. Every function is resolved here, when the
runtime opens, before any generation.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout.context import RolloutContext, RolloutOutput, checked_groups, renumber
from rollout.dynamic import default_rollout, filter_label
from rollout.filters import check_reward_nonzero_std
from rollout.functions import call, load_configured
from rollout.sample import Sample, Status

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
        try:
            return bool(call(fn, cfg, group))
        except Exception as err:
            raise RuntimeError(f"{label} raised {type(err).__name__}: {err}") from err

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
    pending = sum(s.status == Status.PENDING for g in groups for s in g)
    if pending:
        total = sum(len(g) for g in groups)
        raise ValueError(f"{where} {pending} of {total} samples still 'pending' (never generated): "
                         "generate them with ctx.generate(samples) before returning them")
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
        out = call(self.rollout_fn, ctx, iteration)
        groups = rollout_groups(out, self.cfg.rollout.rollout_function_path,
                                self.cfg.rollout.n_samples_per_prompt)
        if not isinstance(out, RolloutOutput):
            out = RolloutOutput(groups=renumber(groups))
        out.stats.setdefault("rollout/prompts_drawn", float(ctx.data_position - start))
        out.stats["rollout/data_position_end"] = float(ctx.data_position)
        return out
