"""The default rollout function, with slime's dynamic sampling and partial rollouts.

    groups = partial groups left by the last iteration (partial_rollout) + new prompts, so that a
             round holds over_sampling_batch_size groups
    repeat: generate one step of every unfinished sample (engine: chunk_tokens tokens, or the
            whole response; custom generate: whole samples)
            finished groups -> scored -> kept if filter(group) else filtered
            stop once rollout_batch_size groups are kept; the rest are aborted
    a round used up without enough kept -> draw another round (at most max_rounds)

With no filter every finished group is kept, and with the defaults (over_sampling_batch_size =
rollout_batch_size, no chunking) this is one batched engine call over the whole batch.

"Abort" with the torch engine: generation stops between steps (a step is ``chunk_tokens`` tokens
of every unfinished sample, or whole responses); what is in flight at that point is the samples'
tokens so far. SGLang aborts requests mid-flight (``/abort_request``); here nothing is cut inside a
step, so ``generation_chunk_tokens`` sets how fine-grained stopping is.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout.context import RolloutContext, RolloutOutput, renumber
from rollout.partial import abort_group, load_partial_groups, reopen
from rollout.sample import Sample, Status

MAX_ROUNDS = 8
FILTER_KEY = "rollout.dynamic_sampling_filter_path"
DEFAULT_FILTER = "rollout.filters:check_reward_nonzero_std"


def filter_label(cfg) -> str:
    """The dynamic sampling filter in words, for errors: its config key and function (the
    default one says why it is on when the key is unset)."""
    r = cfg.rollout
    path = r.dynamic_sampling_filter_path
    if path is None and r.over_sampling_batch_size is not None:
        return f"{FILTER_KEY} (unset: {DEFAULT_FILTER}, as rollout.over_sampling_batch_size is set)"
    if path == "default":
        return f"{FILTER_KEY} 'default' ({DEFAULT_FILTER})"
    return f"{FILTER_KEY} '{path}'"


def group_finished(group: list[Sample]) -> bool:
    return all(s.status != Status.PENDING for s in group)


def default_rollout(ctx: RolloutContext, iteration: int,
                    keep: Callable[[list[Sample]], bool] | None = None,
                    max_rounds: int = MAX_ROUNDS) -> RolloutOutput:
    """``rollout_batch_size`` kept groups (fewer only if ``max_rounds`` rounds ran out)."""
    r = ctx.cfg.rollout
    target, round_size = r.rollout_batch_size, r.over_sampling_batch_size or r.rollout_batch_size
    start_position = ctx.data_position
    pending: list[list[Sample]] = []
    if r.partial_rollout:
        # iteration i trains on version i, on samples at most max_staleness versions older
        oldest = iteration - ctx.cfg.trainer.max_staleness
        pending = [[reopen(s, ctx.engine.weight_version, r.mask_offpolicy_in_partial_rollout, oldest)
                    for s in g] for g in load_partial_groups(ctx.lake, ctx.run_id, iteration)]
    resumed = len(pending)
    kept: list[list[Sample]] = []
    filtered: list[list[Sample]] = []
    active: list[list[Sample]] = []
    failed = rounds = 0
    while len(kept) < target and rounds < max_rounds:
        rounds += 1
        active = pending + ctx.take_groups(max(0, round_size - len(pending)))
        pending = []
        while active and len(kept) < target:
            ctx.generate([s for g in active for s in g])
            done = [g for g in active if group_finished(g)]
            active = [g for g in active if not group_finished(g)]
            if keep is None:
                kept.extend(done)
                continue
            failed += ctx.score([s for g in done for s in g])
            for g in done:
                (kept if keep(g) else filtered).append(g)
    aborted = [abort_group(g) for g in active] + kept[target:]
    kept = kept[:target]
    if not kept:
        raise RuntimeError(f"dynamic sampling kept no group in {rounds} rounds of {round_size} "
                           f"prompts ({len(filtered)} filtered by {filter_label(ctx.cfg)}): "
                           "check the filter and the rewards")
    stats = {"rollout/groups_kept": float(len(kept)), "rollout/groups_filtered": float(len(filtered)),
             "rollout/groups_aborted": float(len(aborted)), "rollout/groups_resumed": float(resumed),
             "rollout/rounds": float(rounds), "rollout/reward_failed_in_filter": float(failed),
             "rollout/prompts_drawn": float(ctx.data_position - start_position),
             "rollout/data_position_end": float(ctx.data_position)}
    return RolloutOutput(groups=renumber(kept), filtered=renumber(filtered),
                         aborted=renumber(aborted), stats=stats)
