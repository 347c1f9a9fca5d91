"""Building a run's data, rewards and rollout functions from its config (called by the runtime
when it opens, so every bad file, key or function path fails before any generation)."""

from __future__ import annotations

from rewards.registry import Scorer
from rewards.tasks import load_task
from rollout.data import (
    PromptDataset,
    check_prompt_lengths,
    drop_long_prompts,
    load_prompt_file,
    next_data_position,
)
from rollout.evaluation import build_eval_sets
from rollout.functions import load_configured
from rollout.runner import Rollout


def load_run_data(cfg, tokenizer) -> tuple[PromptDataset, list[dict]]:
    """(training prompts, built-in held-out records). Training prompts come from
    ``data.prompt_data`` when set, else from the built-in ``data.task``; prompts longer than
    ``rollout_max_prompt_len`` tokens are dropped and counted."""
    d = cfg.data
    split = load_task(d.task, d.held_out_size) if d.task else None
    if d.prompt_data:
        records = load_prompt_file(d.prompt_data, d.input_key, d.label_key, d.metadata_key, d.tool_key)
        source = d.prompt_data
    elif split is not None:
        records, source = split.train, f"builtin:{d.task}"
    else:
        raise ValueError("no prompt data: set data.prompt_data (a JSONL/Parquet file) or data.task")
    records, skipped = drop_long_prompts(records, tokenizer, d.rollout_max_prompt_len,
                                         d.apply_chat_template)
    limit = d.max_prompt_tokens or context_limit(cfg, tokenizer)
    if limit is not None:
        check_prompt_lengths(records, tokenizer, limit, d.apply_chat_template, source)
    dataset = PromptDataset(records, seed=cfg.seed, shuffle=d.rollout_shuffle, source=source,
                            skipped_too_long=skipped)
    return dataset, (split.held_out if split else [])


# the names HF configs give the context length (transformers' attribute maps: GPT-2's
# n_positions/n_ctx, ChatGLM's seq_length, ...), read from config.json without importing it
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length",
                "max_sequence_length")


def config_positions(config: dict) -> int | None:
    """The context length a ``config.json`` gives under any of ``CONTEXT_KEYS`` (its
    ``text_config``'s for a multimodal one), or None. Reading only max_position_embeddings let
    a GPT-2's over-long prompt through to die mid-run ("index out of range in self")."""
    for section in (config, config.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def context_limit(cfg, tokenizer, response_len: int | None = None) -> int | None:
    """The longest prompt the model can take: the model's context (``config_positions``) -
    ``response_len`` (default rollout_max_response_len); None when the model does not say."""
    if cfg.model.path:
        import json
        from pathlib import Path

        config = json.loads((Path(cfg.model.path) / "config.json").read_text())
        positions = config_positions(config)
    else:
        positions = cfg.model.tiny.max_position_embeddings
    if not positions:
        return None
    return max(1, positions - (response_len or cfg.rollout.rollout_max_response_len))


def attach_rollout(rt) -> None:
    """Resolve the run's reward, rollout/generate/filter/eval functions and eval sets onto the
    runtime ``rt``, and its data position (read back from the lake on a resume)."""
    cfg = rt.cfg
    rt.reward_fn = Scorer.from_config(cfg)
    rt.rollout = Rollout(cfg)
    rt.eval_fn = load_configured("eval_function_path", cfg.eval.eval_function_path)
    source = f"builtin:{cfg.data.task}" if cfg.data.task else rt.dataset.source
    rt.eval_sets = build_eval_sets(cfg, rt.held_out, source)
    for eval_set in rt.eval_sets:  # as the training prompts (they were generated truncated)
        limit = cfg.data.max_prompt_tokens or context_limit(cfg, rt.tokenizer,
                                                            eval_set.sampling.max_new_tokens)
        if limit is not None:
            check_prompt_lengths(eval_set.records, rt.tokenizer, limit,
                                 cfg.data.apply_chat_template, eval_set.source)
    rt.data_position = next_data_position(rt.lake, rt.run_id, cfg.rollout.rollout_batch_size)
