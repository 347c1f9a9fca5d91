"""The checks ``rlake run`` / ``rlake resume`` make first (``infra.startup``'s ``check(cfg)``):
everything about a config that can be checked in seconds (device, paths, the lake's URI, the
model folder, every data file, reward names, Megatron's shape), before anything slow starts or
anything is recorded. Each refusal is a ``StartupError``: one line naming the key, file or path
and what is allowed."""

from __future__ import annotations

import errno
import json
import tempfile
from pathlib import Path

from infra.config import RunConfig
from infra.tokenizer import missing_tokenizer


class StartupError(ValueError):
    """A run cannot start: one line naming the key, file or path and what is allowed."""


def _writable_dir(path: Path, key: str) -> None:
    """Create ``path`` if needed and write a probe file in it; errors name ``key`` and the path."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as err:
        raise StartupError(f"{key} '{path}': {describe_os_error(err)}") from None


def describe_os_error(err: OSError) -> str:
    """``err`` as a short reason; a full disk says so (and where)."""
    if err.errno == errno.ENOSPC:
        return f"no space left on device{f' (writing {err.filename})' if err.filename else ''}"
    return err.strerror or str(err)


def check_lake_uri(cfg: RunConfig) -> None:
    """A local lake folder must be a folder we can write; a remote URI's scheme must be one the
    lake knows (its credentials are checked on first use, where errors name ``lake_uri``)."""
    uri = cfg.resolved_lake_uri
    scheme, sep, rest = uri.partition("://")
    if sep and scheme not in ("file", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"):
        raise StartupError(f"lake_uri '{uri}': unknown scheme '{scheme}://' "
                           "(use a folder, file://, s3://, gs:// or az://)")
    if sep and scheme != "file":
        return
    path = Path(rest if sep else uri)
    if path.exists() and not path.is_dir():
        raise StartupError(f"lake_uri '{uri}': is a file, not a folder")
    _writable_dir(path, "lake_uri")


def check_data(cfg: RunConfig, new_run: bool = True) -> None:
    """Read every configured data file once (format, encoding, keys, a row's own ``rm_type``;
    for a ``new_run``, the labels its SFT warm-up trains on): errors name file and line."""
    from rewards.registry import check_labels
    from rollout.data import check_sft_labels, load_prompt_file
    from rollout.evaluation import prompt_file_keys

    d, r = cfg.data, cfg.rollout
    files = []
    if d.prompt_data:
        files.append((d.prompt_data, (d.input_key, d.label_key, d.metadata_key, d.tool_key),
                      r.rm_type, r.custom_rm_path))
    elif d.task is None:
        raise StartupError("no prompt data: set data.prompt_data (a JSONL/Parquet file) or data.task")
    # an eval set's keys as it is built (rollout.evaluation): its tool_key was not checked here
    # an eval set's own rm_type scores it, even in a run with a custom reward (Scorer.from_config)
    files += [(ds.path, prompt_file_keys(ds, d), ds.rm_type or r.rm_type,
               None if ds.rm_type else r.custom_rm_path) for ds in cfg.eval.datasets if ds.path]
    for n, (path, keys, rm_type, custom_rm_path) in enumerate(files):
        records = load_prompt_file(path, *keys)
        check_row_rewards(records, path, r.rm_url)
        try:  # a row without a label, scored by a reward that compares with it
            check_labels(records, path, rm_type, custom_rm_path)
            if new_run and n == 0 and d.prompt_data:
                check_sft_labels(cfg, records, path)
        except ValueError as e:
            raise StartupError(str(e)) from None


def check_row_rewards(records: list[dict], source: str, rm_url: str | None) -> None:
    """A row's ``metadata.rm_type`` (which scores it instead of the run's reward) names a
    reward rlake knows: an unknown one failed each of its samples, every iteration, with one
    warning for the run (review, 2026-11-29)."""
    from rollout.data import locate

    known: set[str] = set()
    for i, rec in enumerate(records):
        name = (rec.get("metadata") or {}).get("rm_type")
        if not name or name in known:
            continue
        _known_reward(str(name), rm_url, f"{locate(source, rec.get('row', i))}: metadata rm_type")
        known.add(name)


def _known_reward(name: str, rm_url: str | None, where: str) -> None:
    """``name`` is a reward rlake knows; else a StartupError starting with ``where``."""
    from rewards.registry import resolve_rm_type

    try:
        resolve_rm_type(name, rm_url)
    except ValueError as e:
        raise StartupError(f"{where}: {e}") from None


def check_device(cfg: RunConfig) -> None:
    """``device: cuda`` where torch sees no CUDA device: the ConfigError ``bad config value for
    'device': ...`` (docs/gpu.md), here, before the run is recorded. Found in ``open_runtime``
    it came after the record: a failed run holding the id, which ``rlake resume`` could not
    mend (it reads ``device`` from the recorded config) (review, 2026-11-29). Only an explicit
    cuda imports torch here (~2 s); auto and cpu cannot fail."""
    if cfg.device == "cuda":
        from infra.modeling import resolve_device

        resolve_device(cfg.device)


def check(cfg: RunConfig) -> None:
    """Everything about ``cfg`` that can be checked in seconds, before anything slow starts."""
    check_device(cfg)
    _writable_dir(Path(cfg.home), "home")
    check_lake_uri(cfg)
    unusable = cfg.model.path and (not_a_model_folder(cfg.model.path)
                                   or missing_tokenizer(cfg.model.path)
                                   or unreadable_model_file(cfg.model.path))
    if unusable:
        raise StartupError(unusable)
    check_data(cfg)
    check_reward_names(cfg)
    check_megatron_model(cfg)


def check_megatron_model(cfg: RunConfig) -> None:
    """What the Megatron ranks need that config load cannot know, refused before the run is
    recorded (each rank failed at start-up with a traceback): ``model.path``'s heads, kv heads,
    MLP width and layers split over TP and PP (``megatron_shape_problem``; config load checks
    ``model.tiny``'s), and PP > 1 with ``device: auto`` where this machine has no CUDA (ranks
    started here; Ray places its rank actors on the cluster's GPUs)."""
    from infra.config import megatron_shape_problem

    trainer = cfg.trainer
    if trainer.backend != "megatron":
        return
    if cfg.model.path and (Path(cfg.model.path) / "config.json").is_file():
        file = Path(cfg.model.path) / "config.json"
        hf = json.loads(file.read_text())
        heads = hf.get("num_attention_heads")
        problem = megatron_shape_problem(
            trainer, heads, hf.get("num_key_value_heads") or heads, hf.get("num_hidden_layers"),
            hf.get("intermediate_size"), f"model.path {file}")
        if problem:
            raise StartupError(problem)
    if (trainer.pipeline_model_parallel_size > 1 and cfg.device == "auto"
            and cfg.cluster.ray_address is None):
        import torch

        if not torch.cuda.is_available():
            raise StartupError(f"trainer.pipeline_model_parallel_size="
                               f"{trainer.pipeline_model_parallel_size} needs GPUs (megatron's "
                               "pipeline schedules) and this machine has no CUDA device "
                               "(device: auto): use 1 on CPU")


def not_a_model_folder(path: str | Path) -> str | None:
    """Why ``model.path`` is not an HF model folder, or None."""
    if not Path(path).exists():
        return f"model.path '{path}' does not exist"
    if not (Path(path) / "config.json").exists():
        return f"model.path '{path}' is not an HF model folder (no config.json)"
    return None


def unreadable_model_file(folder: str | Path) -> str | None:
    """Why a file of the model folder cannot be read, or None: config.json and tokenizer.json
    must be JSON, each ``*.safetensors`` file's header whole and covering the file (its header
    alone is read: milliseconds). Found here, a corrupt or truncated file is refused before the
    run is recorded, not after (a ``failed`` run of 0 iterations holding the id)."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    for name in ("config.json", "tokenizer.json"):
        if (folder / name).is_file():
            try:
                json.loads((folder / name).read_bytes())
            except (ValueError, UnicodeDecodeError) as e:
                return f"model.path: {folder / name} is not valid JSON ({e})"
    for weights in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="numpy"):
                pass
        except (SafetensorError, OSError) as e:
            return f"model.path: cannot read the weights file {weights} ({e})"
    return None


def check_reward_names(cfg: RunConfig) -> None:
    """Each ``rm_type`` the run scores with is one rlake knows (an eval set's was found only
    after the run was recorded, without its key). A ``custom_rm_path`` scores every set."""
    if cfg.rollout.custom_rm_path:
        return
    names = [("rollout.rm_type", cfg.rollout.rm_type)]
    names += [(f"eval.datasets.{i}.rm_type (dataset '{ds.name}')", ds.rm_type)
              for i, ds in enumerate(cfg.eval.datasets) if ds.rm_type]
    for key, name in names:
        _known_reward(name, cfg.rollout.rm_url, key)
