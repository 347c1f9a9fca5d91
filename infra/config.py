"""Run configuration: pydantic models, loaded from YAML with ``--set a.b=c`` overrides.

Names follow slime's flags where one exists (``rollout_batch_size``, ``n_samples_per_prompt``,
``eps_clip``, ...). Unknown keys and bad values are rejected with the key in the message.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_type_hints

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from rollout.sglang.config import SGLangConfig


class ConfigError(ValueError):
    """A bad config: the message names the key and what is allowed."""


class _Section(BaseModel):
    # inf and nan are refused in every float (``trainer.lr: .inf`` trained to NaN weights and
    # reported success)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: Any) -> Any:
        """``seed: true`` is a mistake, not seed 1 (pydantic reads a bool as 0 or 1)."""
        if isinstance(value, bool):
            annotation = cls.model_fields[info.field_name].annotation
            types = {annotation, *get_args(annotation)}
            if bool not in types and types & {int, float}:
                raise ValueError("expected a number, not a boolean")
        return value


RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_run_id(run_id: str) -> str:
    """A run id names a folder under ``home/runs`` and the MLflow model ``rlake-{id}``: letters,
    digits, '.', '_' and '-', starting with a letter or digit, at most 128 characters (an id
    such as ``../x`` wrote outside the home). Returns it; a ValueError names what is allowed."""
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
        raise ValueError(f"run id {run_id!r} is not allowed: use letters, digits, '.', '_' and '-', "
                         "starting with a letter or digit, at most 128 characters")
    return run_id


# the advantage estimators whose baseline is the mean of each prompt's samples: with one sample
# per prompt every advantage is 0 and nothing trains
GROUP_BASELINE_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus_baseline")


class TinyModelConfig(_Section):
    """The tiny Qwen2 the quickstart builds (no download)."""

    num_hidden_layers: int = Field(2, ge=1)
    hidden_size: int = Field(128, ge=8)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(512, ge=8)
    max_position_embeddings: int = Field(64, ge=8)
    tie_word_embeddings: bool = True


class ModelConfig(_Section):
    path: str | None = Field(None, description="HF model folder; None builds the tiny model")
    tiny: TinyModelConfig = TinyModelConfig()


class DataConfig(_Section):
    task: Literal["addition", "countdown"] | None = Field(
        "addition", description="built-in synthetic task (its held-out set is the default eval set)")
    prompt_data: str | None = Field(
        None, description="JSONL/Parquet prompt file, 'path@[a:b]' slices rows; overrides task "
                          "for training prompts")
    input_key: str = "prompt"
    label_key: str | None = "label"
    metadata_key: str | None = None
    tool_key: str | None = Field(None, description="key of the tool specs (given to the chat template)")
    apply_chat_template: bool = Field(False, description="render prompts with the tokenizer's "
                                      "chat template (plain text when it has none)")
    rollout_max_prompt_len: int | None = Field(None, ge=1, description="longer prompts are skipped "
                                               "(and counted)")
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="a longer prompt is an error naming its file and line (when "
                                "rollout_max_prompt_len does not skip it); None: the model's "
                                "context (max_position_embeddings) less rollout_max_response_len")
    held_out_size: int = Field(500, ge=1, description="held-out problems never trained on")
    rollout_shuffle: bool = True


def _check_function(key: str, path: str | None) -> str | None:
    """Resolve + signature-check a configured function path at config load."""
    if path:
        from rollout.functions import load_configured  # noqa: PLC0415 - infra -> rollout at load

        load_configured(key, path)
    return path


class _SGLangChecks(_Section):
    """What ``SGLangConfig.__post_init__`` allows that a field's type cannot say (a dataclass
    error had no key in it, and inf, nan or a negative size passed: review, 2026-11-29)."""

    @model_validator(mode="after")
    def _servers_or_urls(self) -> _SGLangChecks:
        if not self.urls and self.num_servers < 1:
            raise ValueError("num_servers must be >= 1 when no urls are given")
        return self


def _positive(kind: type) -> Any:
    return Annotated[kind, Field(gt=0)]


# the limits of rollout.sglang's keys as (type, default), ``...``: SGLangConfig's default; the
# keys themselves, the other types and defaults are SGLangConfig's (one list: the engine builds
# its SGLangConfig from this section's values)
_SGLANG_LIMITS: dict[str, tuple[Any, Any]] = {
    "num_servers": (Annotated[int, Field(ge=0)], ...),
    # null: the top-level ``device`` (cpu or cuda, auto resolved where the engine starts), so
    # ``device: cuda`` alone launches GPU servers (docs/sglang.md)
    "device": (Literal["cpu", "cuda"] | None, None),
    # null: SGLangConfig's 65536 on cpu, SGLang's own sizing from GPU memory on cuda
    "max_total_tokens": (_positive(int) | None, None),
    "concurrency": (_positive(int), ...),
    "request_batch_size": (_positive(int), ...),
    "weight_sync": (Literal["disk", "distributed"], ...),
    # nccl needs CUDA on both ends: refused off ``device: cuda`` (RunConfig._sglang_dist_backend)
    "dist_backend": (Literal["gloo", "nccl"], ...),
    "pause_mode": (Literal["abort", "retract", "in_place"], ...),
    "bucket_mb": (_positive(int), ...),
    "startup_timeout_s": (_positive(float), ...),
    "health_interval_s": (_positive(float), ...),
    "health_timeout_s": (_positive(float), ...),
    "health_failures": (_positive(int), ...),
    "max_request_attempts": (_positive(int), ...),
    "request_timeout_s": (_positive(float), ...),
}


def _sglang_section() -> type[_Section]:
    """``rollout.sglang`` as a section like the others (unknown keys, inf, nan, a boolean for a
    number refused with the key named), its fields SGLangConfig's with ``_SGLANG_LIMITS``."""
    hints = get_type_hints(SGLangConfig)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(SGLangConfig):
        default = f.default_factory if f.default is dataclasses.MISSING else f.default
        kind, limit_default = _SGLANG_LIMITS.get(f.name, (hints[f.name], ...))
        if limit_default is not ...:
            default = limit_default
        fields[f.name] = ((kind, Field(default_factory=default)) if callable(default)
                          else (kind, default))
    return create_model("SGLangSection", __base__=_SGLangChecks, __doc__=SGLangConfig.__doc__,
                        **fields)


SGLangSection = _sglang_section()


class RolloutConfig(_Section):
    engine: Literal["torch", "sglang"] = "torch"
    sglang: SGLangSection = Field(default_factory=SGLangSection,
                                  description="SGLang engine settings (docs/sglang.md)")
    rollout_batch_size: int = Field(32, ge=1, description="prompts (groups) trained on per iteration")
    n_samples_per_prompt: int = Field(8, ge=1)
    rollout_max_response_len: int = Field(6, ge=1)
    rollout_temperature: float = Field(1.0, gt=0)
    rollout_top_p: float = Field(1.0, gt=0, le=1)
    rm_type: str = Field("addition", description="reward function name in the registry")
    custom_rm_path: str | None = Field(None, description="fn(cfg, sample) -> float | dict")
    rm_url: str | None = Field(None, description="URL of the remote reward model (rm_type: remote)")
    rm_timeout_s: float = Field(10.0, gt=0, description="remote reward: HTTP timeout per attempt")
    rm_retries: int = Field(2, ge=0, description="remote reward: retries after the first attempt")
    reward_timeout_s: float = Field(30.0, gt=0, description="a reward call running longer fails its sample")
    reward_max_workers: int = Field(8, ge=1, description="concurrent reward calls")
    max_failed_reward_iterations: int = Field(
        3, ge=1, description="stop the run (non-zero exit) after this many consecutive iterations "
                             "whose every reward failed (each one is warned about)")
    rollout_function_path: str | None = Field(None, description="fn(ctx, iteration) -> groups")
    custom_generate_function_path: str | None = Field(
        None, description="fn(ctx, sample, sampling) -> sample (per-sample generation)")
    over_sampling_batch_size: int | None = Field(
        None, ge=1, description="prompts drawn per round (>= rollout_batch_size); None: rollout_batch_size")
    dynamic_sampling_filter_path: str | None = Field(
        None, description="fn(cfg, group) -> bool; 'default' keeps groups with reward std > 1e-6")
    generation_chunk_tokens: int | None = Field(
        None, ge=1, description="engine calls generate at most this many tokens, then groups are "
                                "checked (and the rest aborted once enough are kept)")
    partial_rollout: bool = Field(False, description="keep aborted samples, continue them next iteration")
    num_engines: int = Field(1, ge=1, description="engines as Ray actors (> 1 needs cluster.ray_address)")
    num_cpus_per_engine: float = Field(1.0, ge=0, description="Ray CPUs per engine actor")
    rollout_num_gpus_per_engine: float = Field(0.0, ge=0, description="Ray GPUs per engine actor (slime)")
    cuda_graph: bool = Field(
        True, description="torch engine on CUDA: replay the decode step as a CUDA graph "
                          "(5.8-16x HF generate on an H200: docs/gpu.md); no effect on CPU")
    mask_offpolicy_in_partial_rollout: bool = Field(
        False, description="loss_mask 0 on tokens an older policy generated")

    @field_validator("rollout_function_path", "custom_generate_function_path", "custom_rm_path",
                     "dynamic_sampling_filter_path")
    @classmethod
    def _functions(cls, value: str | None, info) -> str | None:
        if value == "default" and info.field_name == "dynamic_sampling_filter_path":
            return value
        return _check_function(info.field_name, value)

    @model_validator(mode="after")
    def _over_sampling(self) -> RolloutConfig:
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size < self.rollout_batch_size:
            raise ValueError(f"over_sampling_batch_size ({self.over_sampling_batch_size}) must be >= "
                             f"rollout_batch_size ({self.rollout_batch_size})")
        return self


# what the megatron backend trains: every estimator but ppo (it has no critic)
MEGATRON_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
MEGATRON_PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                           "data_parallel_size")


def megatron_shape_problem(trainer: Any, heads: int | None, kv_heads: int | None,
                           layers: int | None, ffn: int | None, source: str) -> str | None:
    """Why the model ``source`` describes (its attention heads, kv heads, decoder layers and
    MLP width; None: unknown, not checked) cannot be split over the trainer section's tensor
    and pipeline parallel sizes, or None. Megatron shards heads, kv heads (query groups) and
    the MLP over TP ranks and layers over PP stages: found at rank start-up, that was a
    traceback per rank after the run was recorded."""
    tp = int(getattr(trainer, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(trainer, "pipeline_model_parallel_size", 1) or 1)
    for key, size, what, count in (
            ("tensor_model_parallel_size", tp, "num_attention_heads", heads),
            ("tensor_model_parallel_size", tp, "num_key_value_heads", kv_heads),
            ("tensor_model_parallel_size", tp, "intermediate_size", ffn),
            ("pipeline_model_parallel_size", pp, "num_hidden_layers", layers)):
        if count is not None and int(count) % size:
            return (f"trainer.{key}={size} must divide the model's {what} ({count}, {source})")
    return None


def megatron_world_size(trainer: Any) -> int:
    """tensor_model_parallel_size * pipeline_model_parallel_size * data_parallel_size of a
    trainer section (a missing or None size is 1): how many Megatron ranks it runs."""
    sizes = [getattr(trainer, k, None) for k in MEGATRON_PARALLEL_SIZES]
    sizes = [1 if v is None else int(v) for v in sizes]
    for k, v in zip(MEGATRON_PARALLEL_SIZES, sizes, strict=True):
        if v < 1:
            raise ValueError(f"trainer.{k}={v}: must be >= 1")
    return sizes[0] * sizes[1] * sizes[2]


class TrainerConfig(_Section):
    """The trainer: slime's flag names (snake_case). Formulas: docs/algorithms.md."""

    backend: Literal["torch", "megatron"] = "torch"
    loss_type: Literal["policy_loss", "sft"] = Field(
        "policy_loss", description="sft: train the RL loop with SFT loss on rollout responses")
    sft_min_reward: float | None = Field(
        None, description="loss_type sft only: train only on samples with reward >= this "
                          "(rejection sampling); None trains on every sample")
    advantage_estimator: Literal["grpo", "gspo", "reinforce_plus_plus",
                                 "reinforce_plus_plus_baseline", "ppo"] = "grpo"
    lr: float = Field(1e-3, gt=0)
    critic_lr: float | None = Field(None, gt=0, description="ppo critic lr; None = lr")
    weight_decay: float = Field(0.0, ge=0)
    # 0 <= beta < 1 as torch.optim.AdamW requires: beta2 = 1 divides by a zero bias correction
    # (every weight NaN, no error), beta1 = 1 by zero too (ZeroDivisionError mid-run)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.99, ge=0, lt=1)
    global_batch_size: int = Field(256, ge=1, description="samples per optimizer step")
    micro_batch_size: int = Field(256, ge=1, description="samples per forward/backward")
    clip_grad: float = Field(1.0, gt=0)
    eps_clip: float = Field(0.2, gt=0)
    eps_clip_high: float | None = Field(None, gt=0)
    eps_clip_c: float | None = Field(None, gt=1)
    entropy_coef: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.0, ge=0)
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    kl_coef: float = Field(0.0, ge=0, description="KL in the reward (ppo, reinforce_plus_plus*)")
    ref_load: str | None = Field(
        None, description="HF folder of the frozen reference; None = the weights at version 0")
    normalize_advantages: bool | None = Field(
        None, description="whiten advantages; None = the estimator's default "
                          "(on for reinforce_plus_plus*, off otherwise)")
    disable_grpo_std_normalization: bool = False
    use_tis: bool = False
    tis_clip: float = Field(2.0, gt=0)
    tis_clip_low: float = Field(0.0, ge=0)
    loss_aggregation: Literal["sample_mean", "token_mean"] = "sample_mean"
    gamma: float = Field(1.0, ge=0, le=1)
    lambd: float = Field(1.0, ge=0, le=1)
    value_clip: float = Field(0.2, gt=0)
    max_staleness: int = Field(0, ge=0, description="k: train on samples with version >= v - k")
    tensor_model_parallel_size: int = Field(1, ge=1)
    pipeline_model_parallel_size: int = Field(1, ge=1)
    recompute_granularity: Literal["full"] | None = Field(
        None, description="full: activation checkpointing of every decoder layer (torch trainer)")
    vocab_chunk_size: int | None = Field(
        16384, ge=1, description="log-probs and entropy are computed over this many vocabulary "
                                 "ids at a time, so [batch, tokens, vocab] logits never exist; "
                                 "null: from the model's full logits")
    share_prompt_forward: bool = Field(
        True, description="the samples of one prompt run its tokens once in the training "
                          "forward (same loss and gradient up to rounding; off under "
                          "recompute_granularity: full)")

    @model_validator(mode="after")
    def _kl_once(self) -> TrainerConfig:
        if self.use_kl_loss and self.kl_coef > 0:
            raise ValueError("use_kl_loss and kl_coef > 0 both put KL in: choose one "
                             "(KL in the loss or in the reward, not both)")
        if self.tis_clip_low > self.tis_clip:
            raise ValueError(f"tis_clip_low ({self.tis_clip_low}) must be <= tis_clip "
                             f"({self.tis_clip})")
        return self


class SFTConfig(_Section):
    """Supervised warm-up before RL (its own Prefect flow, ``loss_type: sft``)."""

    enabled: bool = True
    steps: int = Field(1000, ge=0, description="at most this many steps")
    batch_size: int = Field(128, ge=1)
    lr: float = Field(3e-3, gt=0)
    stop_at_accuracy: float | None = Field(
        0.5, gt=0, le=1, description="stop once greedy accuracy on training problems reaches this")
    check_every: int = Field(10, ge=1, description="steps between accuracy checks")
    check_size: int = Field(200, ge=1, description="training problems used for the check")


class EvalDatasetConfig(_Section):
    """One evaluation set (slime's eval dataset config). ``path: null`` is the built-in task's
    held-out set. Unset fields fall back to the data/rollout settings."""

    name: str = "held_out"
    path: str | None = Field(None, description="JSONL/Parquet file (path@[a:b]); null: built-in held-out")
    rm_type: str | None = None
    n_samples_per_eval_prompt: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0, description="0: greedy; null: greedy if eval.greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    max_response_len: int | None = Field(None, ge=1)
    input_key: str | None = None
    label_key: str | None = None
    metadata_key: str | None = None


class EvalConfig(_Section):
    eval_interval: int = Field(5, ge=1, description="evaluate every N iterations")
    greedy: bool = True
    datasets: list[EvalDatasetConfig] = Field(default_factory=lambda: [EvalDatasetConfig()])
    eval_function_path: str | None = Field(None, description="fn(ctx, dataset) -> groups")

    @field_validator("eval_function_path")
    @classmethod
    def _function(cls, value: str | None) -> str | None:
        return _check_function("eval_function_path", value)

    @model_validator(mode="after")
    def _unique_names(self) -> EvalConfig:
        names = [d.name for d in self.datasets]
        if len(set(names)) != len(names):
            raise ValueError(f"eval dataset names must be unique, got {names}")
        return self


# HOST:PORT or ray://HOST:PORT (an IPv6 host in brackets)
RAY_ADDRESS = re.compile(r"^(ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.\-]*):(?P<port>\d{1,5})$")


class ClusterConfig(_Section):
    """Ray (docs/cluster.md). ``ray_address``: null = no Ray at all; ``local`` = start one on
    127.0.0.1; anything else = join that cluster (``HOST:PORT`` or ``ray://HOST:PORT``)."""

    ray_address: str | None = None
    num_cpus: int | None = Field(None, ge=1, description="local Ray: logical CPUs (default: enough)")
    trainer_on_ray: bool = Field(True, description="with Ray: the trainer runs as a Ray actor")
    trainer_num_cpus: float = Field(1.0, ge=0, description="the trainer actor's CPUs; each Megatron "
                                    "rank's when the ranks are Ray actors (world > 1)")
    trainer_num_gpus: float = Field(0.0, ge=0, description="the trainer actor's GPUs (Megatron "
                                    "ranks as actors: 1 each on cuda, see docs/cluster.md)")
    trainer_call_timeout_s: float = Field(
        1800.0, gt=0, description="Megatron ranks as Ray actors: one collective call (train, "
                                  "save, ...); past it every rank is stopped and the call fails")
    engine_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each engine needs (places engines)")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    max_engine_restarts: int = Field(3, ge=0, description="Ray restarts of a dead engine actor")
    placement_timeout_s: float = Field(120.0, gt=0)
    engine_call_timeout_s: float = Field(1800.0, gt=0, description="one engine call; then it fails")

    @field_validator("ray_address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        # Ray's own "Invalid address format: foo" came only after the run was recorded
        # (review, 2026-11-29)
        if value is None or value == "local":
            return value
        found = RAY_ADDRESS.match(value)
        if found is None or not 1 <= int(found.group("port")) <= 65535:
            raise ValueError("must be null (no Ray), 'local', or a cluster address HOST:PORT "
                             "(or ray://HOST:PORT)")
        return value

    @field_validator("engine_resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU"):
                raise ValueError(f"{name!r} is not a custom resource: set rollout.num_cpus_per_engine "
                                 "/ rollout.rollout_num_gpus_per_engine")
            if not math.isfinite(amount) or amount < 0:
                raise ValueError(f"{name!r}: {amount} is not a non-negative amount")
        return value


class RunConfig(_Section):
    """The whole run. ``home`` holds everything a run writes; ``lake_uri`` defaults under it."""

    run_id: str | None = None
    home: str = "./rlake-home"
    lake_uri: str | None = None
    storage_options: dict[str, str] = Field(default_factory=dict)
    seed: int = 0
    mode: Literal["sync", "async"] = Field(
        "sync", description="async: rollout runs ahead of training by at most "
                            "trainer.max_staleness versions (docs/operations.md)")
    prefect_task_runs: bool = Field(
        True, description="each step of an iteration (generate, score, lake write and read, "
                          "train, publish, record, eval) is a Prefect task run; false: the "
                          "iteration stays one flow run and its steps are plain calls with the "
                          "same retries (faster on small CPU runs: docs/operations.md)")
    pin_cores: bool = Field(
        True, description="on Linux: the training process keeps torch_threads cores of its "
                          "own, its children (async: the rollout process; the run's helpers: "
                          "Prefect's server, the MLflow tracker) share the others; sync mode "
                          "only with the torch engine and trainer on cpu and no "
                          "custom_rm_path, never with Ray "
                          "(flows/rl.pins_cores, infra/affinity.py)")
    num_rollout: int = Field(40, ge=0, description="RL iterations (slime: num_rollout)")
    deterministic: bool = False
    keep_checkpoints: int = Field(3, ge=1)
    save_interval: int = Field(
        10, ge=1, description="write a checkpoint every N iterations (and v0 and the last); the "
                              "lake's train_steps are the write-ahead log for the versions between")
    torch_threads: int = Field(1, ge=1)
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the torch engine, trainer, reference and critic run; auto = "
                           "cuda when a CUDA device is present (docs/gpu.md)")
    dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="weights/compute dtype; auto = bf16 on cuda, fp32 on cpu. The torch "
                            "trainer keeps fp32 master weights and optimizer state under bf16")
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    sft: SFTConfig = SFTConfig()
    eval: EvalConfig = EvalConfig()
    cluster: ClusterConfig = ClusterConfig()

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str | None) -> str | None:
        return None if value is None else check_run_id(value)

    @model_validator(mode="after")
    def _group_baseline_needs_a_group(self) -> RunConfig:
        estimator = self.trainer.advantage_estimator
        if (estimator in GROUP_BASELINE_ESTIMATORS and self.trainer.loss_type == "policy_loss"
                and self.rollout.n_samples_per_prompt < 2):
            raise ValueError(f"trainer.advantage_estimator '{estimator}' needs "
                             "rollout.n_samples_per_prompt >= 2: its baseline is the mean of each "
                             "prompt's samples, so with one every advantage is 0 and nothing trains "
                             "(one sample per prompt: 'reinforce_plus_plus' or 'ppo')")
        return self

    @model_validator(mode="after")
    def _megatron_supports(self) -> RunConfig:
        """The megatron backend has no critic (ppo) and no SFT loss in the RL loop
        (``loss_type: sft``): refuse them here, not after the SFT warm-up (ppo) or never (sft
        trained the policy loss)."""
        trainer = self.trainer
        if trainer.backend != "megatron":
            for key in MEGATRON_PARALLEL_SIZES[:2]:  # was ignored: one unsplit model trained
                if (size := getattr(trainer, key)) > 1:
                    raise ValueError(f"trainer.{key}={size} needs trainer.backend 'megatron' "
                                     f"(the {trainer.backend} trainer does not split the model: "
                                     "use 1)")
            return self
        if trainer.loss_type != "policy_loss":
            raise ValueError(f"trainer.loss_type '{trainer.loss_type}' is not supported by "
                             "trainer.backend 'megatron': it trains 'policy_loss' only (the "
                             "torch backend has 'sft')")
        if trainer.advantage_estimator not in MEGATRON_ESTIMATORS:
            raise ValueError(f"trainer.advantage_estimator '{trainer.advantage_estimator}' is not "
                             "supported by trainer.backend 'megatron' (it has no critic): use "
                             f"{', '.join(MEGATRON_ESTIMATORS)} (the torch backend has 'ppo')")
        if trainer.pipeline_model_parallel_size > 1 and self.device == "cpu":
            # device auto on a machine without CUDA: infra/startup.py check_megatron_model
            raise ValueError(f"trainer.pipeline_model_parallel_size="
                             f"{trainer.pipeline_model_parallel_size} needs GPUs (megatron's "
                             "pipeline schedules) and device is 'cpu': use 1 on CPU")
        if self.model.path is None:  # the tiny model: its shape is known here (model.path's
            tiny = self.model.tiny   # is read from its config.json at start-up)
            problem = megatron_shape_problem(trainer, tiny.num_attention_heads,
                                             tiny.num_key_value_heads, tiny.num_hidden_layers,
                                             tiny.intermediate_size, "model.tiny")
            if problem:
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _sglang_dist_backend(self) -> RunConfig:
        """``rollout.sglang.dist_backend: nccl`` broadcasts CUDA tensors from the trainer to
        CUDA servers: off ``device: cuda`` it failed only when the first sync began (after the
        SFT warm-up and a server's start), without the key."""
        sg = self.rollout.sglang
        if (self.rollout.engine != "sglang" or sg.weight_sync != "distributed"
                or sg.dist_backend != "nccl"):
            return self
        if self.device != "cuda" or (sg.device or self.device) != "cuda":
            where = (f"rollout.sglang.device is '{sg.device}'" if sg.device not in (None, "cuda")
                     else f"device is '{self.device}'")
            raise ValueError("rollout.sglang.dist_backend 'nccl' (weight_sync: distributed) needs "
                             f"device: cuda, and {where}: use dist_backend 'gloo' off CUDA")
        return self

    @model_validator(mode="after")
    def _engines_need_ray(self) -> RunConfig:
        if self.rollout.num_engines > 1 and self.cluster.ray_address is None:
            raise ValueError(f"rollout.num_engines={self.rollout.num_engines} needs Ray: set "
                             "cluster.ray_address to 'local' or a cluster address (or num_engines: 1)")
        return self

    @model_validator(mode="after")
    def _ray_bundles_hold_something(self) -> RunConfig:
        """With Ray, each actor's bundle asks for some resource: an empty one failed at start,
        in Ray's words ("Bundles cannot be an empty dictionary"), after the run was recorded."""
        r, c = self.rollout, self.cluster
        if c.ray_address is None:
            return self
        if r.num_cpus_per_engine + r.rollout_num_gpus_per_engine + sum(c.engine_resources.values()) <= 0:
            raise ValueError("with Ray, an engine actor needs some resource: rollout.num_cpus_per_engine, "
                             "rollout.rollout_num_gpus_per_engine or cluster.engine_resources > 0")
        if c.trainer_on_ray and c.trainer_num_cpus + c.trainer_num_gpus <= 0:
            raise ValueError("with Ray, the trainer actor needs some resource: cluster.trainer_num_cpus "
                             "or cluster.trainer_num_gpus > 0 (or cluster.trainer_on_ray: false)")
        return self

    @model_validator(mode="after")
    def _async_mode(self) -> RunConfig:
        if self.mode != "async":
            return self
        if self.trainer.max_staleness < 1:
            raise ValueError("mode 'async' needs trainer.max_staleness >= 1 (how many versions "
                             f"rollout may run ahead of training), got {self.trainer.max_staleness}")
        if self.rollout.engine != "torch":
            raise ValueError("mode 'async' supports rollout.engine 'torch' only (its weights are "
                             f"handed over in memory), got '{self.rollout.engine}'")
        if "use_tis" not in self.trainer.model_fields_set:
            # stale samples need the off-policy correction (docs/algorithms.md): on unless the
            # user chose explicitly
            self.trainer.use_tis = True
        return self

    @property
    def resolved_lake_uri(self) -> str:
        return self.lake_uri or str(Path(self.home) / "lake")


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last:
    a second ``lr:`` further down silently won)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str | int | float | bool):
                continue  # an unhashable key: the base loader's own error
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' is given twice in one section", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(text: str) -> Any:
    """``text`` as YAML (safe types), a key given twice in one mapping refused."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def yaml_error_line(err: yaml.YAMLError) -> str:
    """PyYAML's error as one line: the problem and where (line and column, 1-based), without
    the quoted source it prints over several lines."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{problem}{where}"


def _section_keys(path: tuple[Any, ...]) -> list[str]:
    """The keys allowed in the section at ``path`` (list indices skipped), [] if none is known."""
    model: type[BaseModel] = RunConfig
    for part in path:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        inner = [t for t in (field.annotation, *get_args(field.annotation))
                 if isinstance(t, type) and issubclass(t, BaseModel)]
        if not inner:
            return []
        model = inner[0]
    return list(model.model_fields)


def _named_key(loc: tuple[Any, ...], msg: str) -> str | None:
    """The config key a cross-field check's message names (``loc``: the section checked): the
    first dotted key that exists, else the first plain one; None if it names none."""
    section = tuple(p for p in loc if not isinstance(p, int))
    tokens = re.findall(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*", msg)
    for dotted in (True, False):
        for token in tokens:
            if ("." in token) != dotted:
                continue
            *parent, name = token.split(".")
            for path in ((*section, *parent), tuple(parent)):  # relative to the section, or whole
                if name in _section_keys(path):
                    return ".".join((*path, name))
    return None


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"])
    if isinstance(first.get("input"), dict) and first["type"] == "value_error":
        # a check across keys (a section's or the whole config's): the key its message names
        key = _named_key(first["loc"], first["msg"].removeprefix("Value error, ")) or key or "(config)"
    if first["type"] == "extra_forbidden":
        *section, name = first["loc"]
        close = difflib.get_close_matches(str(name), _section_keys(tuple(section)), n=1)
        prefix = "".join(f"{p}." for p in section if not isinstance(p, int))
        return f"unknown config key '{key}'" + (f" (did you mean '{prefix}{close[0]}'?)" if close else "")
    msg = first["msg"].removeprefix("Value error, ")
    got = first.get("input")
    return f"bad config value for '{key}': {msg}" + ("" if isinstance(got, dict) else f" (got {got!r})")


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b=c`` -> (["a", "b"], yaml-parsed c)."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got '{item}'")
    key, raw = item.split("=", 1)
    path = key.strip().split(".")
    if not all(part.strip() for part in path):  # '=5', 'a..b', 'a.': no key to set
        raise ConfigError(f"--set expects key=value with a key such as trainer.lr, got '{item}'")
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {item}: the value is not valid YAML: {yaml_error_line(err)}") from None
    return [part.strip() for part in path], value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item}: '{part}' is not a section")
        node[path[-1]] = value
    return data


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML (or nothing: defaults), apply ``--set`` overrides, validate."""
    data = read_config_file(Path(path)) if path is not None else {}
    return config_from_dict(apply_overrides(data, overrides or []))


def read_config_file(path: Path) -> dict[str, Any]:
    """A YAML config file's mapping; every way it can be unreadable is one line naming it."""
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder: give the YAML file")
    try:
        # utf-8-sig: a byte-order mark some editors write is not part of the YAML
        data = read_yaml(path.read_text(encoding="utf-8-sig")) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {yaml_error_line(err)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config keys")
    return data


def flat_config(cfg: RunConfig) -> dict[str, Any]:
    """Every value of ``cfg`` under its dotted key (``trainer.lr``), sections in their order."""
    out: dict[str, Any] = {}

    def walk(prefix: str, node: dict[str, Any]) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(f"{prefix}{key}.", value)
            else:
                out[f"{prefix}{key}"] = value
    walk("", cfg.model_dump())
    return out


def config_differences(recorded: RunConfig, wanted: RunConfig,
                       ignore: tuple[str, ...] = ("home", "run_id")) -> list[str]:
    """``key: recorded -> wanted`` for every dotted key whose value differs between two
    configs, except the top-level keys in ``ignore`` (where a run's folder and name are
    given apart from its config)."""
    old, new = flat_config(recorded), flat_config(wanted)
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(old.keys() | new.keys())
            if key.split(".")[0] not in ignore and old.get(key) != new.get(key)]
