"""One iteration's rollout from config: pick the rollout function, the filter, the generator.

``rollout_function_path`` replaces ``default_rollout`` entirely (it may return groups or a
``RolloutOutput``). The dynamic sampling filter is ``dynamic_sampling_filter_path`` when set
(``default`` names ``check_reward_nonzero_std``), the default filter when only
``over_sampling_batch_size`` is set, and none otherwise. Every function is resolved here, when the
runtime opens, before any generation.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout.context import RolloutContext, RolloutOutput, renumber
from rollout.dynamic import default_rollout
from rollout.filters import check_reward_nonzero_std
from rollout.functions import call, load_configured
from rollout.sample import Sample


def resolve_filter(cfg) -> Callable[[list[Sample]], bool] | None:
    r = cfg.rollout
    path = r.dynamic_sampling_filter_path
    if path == "default" or (path is None and r.over_sampling_batch_size is not None):
        fn = check_reward_nonzero_std
    elif path is None:
        return None
    else:
        fn = load_configured("dynamic_sampling_filter_path", path)
    return lambda group: bool(call(fn, cfg, group))


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
        if not isinstance(out, RolloutOutput):
            groups = [list(g) for g in out]
            if not groups or not all(isinstance(s, Sample) for g in groups for s in g):
                raise TypeError("rollout_function_path must return a RolloutOutput or a non-empty "
                                "list of groups (lists of Sample)")
            out = RolloutOutput(groups=renumber(groups))
        out.stats.setdefault("rollout/prompts_drawn", float(ctx.data_position - start))
        out.stats["rollout/data_position_end"] = float(ctx.data_position)
        return out
