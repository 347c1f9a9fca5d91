"""Generation primitives: prompts -> pending samples -> generated samples (one or more segments).

``generate_samples`` runs the engine over every still-pending sample once: the prompt is the
prompt tokens plus the response generated so far, so a sample generated in several segments
(``generation_chunk_tokens``, partial rollouts) gets exactly the tokens, log-probs and loss mask
it would have got in one call, with the weight version of each segment in ``weight_versions``.
"""

from __future__ import annotations

from dataclasses import replace

from rollout.data import render_prompt
from rollout.engine import RolloutEngine, SamplingParams
from rollout.sample import Sample, Status


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a plain-text prompt, BOS first when the tokenizer has one."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return ids if bos is None or (ids and ids[0] == bos) else [bos, *ids]


def decode_response(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def make_samples(prompts: list[tuple[int, dict]], tokenizer, n_samples_per_prompt: int,
                 data_source: str, first_group: int = 0, apply_chat_template: bool = False,
                 first_index: int = 0) -> list[Sample]:
    """Pending samples, ``n`` consecutive per prompt (a group), indexed in order from
    ``first_index`` (groups from ``first_group``)."""
    samples = []
    for g, (row, record) in enumerate(prompts):
        text = render_prompt(tokenizer, record["prompt"], apply_chat_template, record.get("tools"))
        ids = encode_prompt(tokenizer, text)
        metadata = dict(record.get("metadata") or {})
        if record.get("tools") is not None:
            metadata.setdefault("tools", record["tools"])
        for _ in range(n_samples_per_prompt):
            samples.append(Sample(group_index=first_group + g, index=first_index + len(samples),
                                  prompt=record["prompt"], prompt_token_ids=ids,
                                  label=record.get("label"), metadata=dict(metadata),
                                  data_source=data_source, row=row))
    return samples


def status_after(finish_reason: str, response_len: int, max_response_len: int) -> Status:
    """stop -> completed; abort -> aborted; otherwise truncated once the response is at its
    maximum length, else still pending (the segment ended, the sample goes on)."""
    if finish_reason == "stop":
        return Status.COMPLETED
    if finish_reason == "abort":
        return Status.ABORTED
    return Status.TRUNCATED if response_len >= max_response_len else Status.PENDING


def generate_samples(engine: RolloutEngine, tokenizer, samples: list[Sample],
                     sampling: SamplingParams, chunk_tokens: int | None = None) -> list[Sample]:
    """Generate the next segment (``chunk_tokens`` tokens, default: up to the maximum response
    length ``sampling.max_new_tokens``) of every pending sample, in place."""
    todo = [s for s in samples if s.status == Status.PENDING]
    by_budget: dict[int, list[Sample]] = {}
    for s in todo:
        left = sampling.max_new_tokens - s.response_length
        by_budget.setdefault(min(left, chunk_tokens or left), []).append(s)
    for budget, group in by_budget.items():
        if budget <= 0:
            for s in group:
                s.status = Status.TRUNCATED
            continue
        results = engine.generate([s.prompt_token_ids + s.response_token_ids for s in group],
                                  replace(sampling, max_new_tokens=budget))
        for sample, res in zip(group, results, strict=True):
            sample.response_token_ids = sample.response_token_ids + list(res.token_ids)
            sample.rollout_log_probs = sample.rollout_log_probs + list(res.logprobs)
            sample.loss_mask = sample.loss_mask + [1] * len(res.token_ids)
            sample.response = decode_response(tokenizer, sample.response_token_ids)
            sample.finish_reason = res.finish_reason
            sample.weight_version = engine.weight_version
            sample.weight_versions = [*sample.weight_versions, engine.weight_version]
            if "engine" in res.meta:  # an engine pool names the member that generated it
                sample.engine = res.meta["engine"]
            sample.status = status_after(res.finish_reason, sample.response_length,
                                         sampling.max_new_tokens)
    return samples
