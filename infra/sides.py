"""The rollout side of a run, on its own: what generating, scoring and appending batches needs.

    rollout side : engine, tokenizer, prompt data + data position, reward fn, rollout functions,
                   sampling, lake (writer)
    training side: trainer, lake (reader), tracker, checkpoints  (``infra.runtime.Runtime``)

``open_rollout_side`` builds it from the run's config without a trainer, a tracker or Prefect, so
async mode (flows/async_run.py) runs it in a second process. It carries the attribute names of
``Runtime`` that the rollout tasks read (``engine``, ``dataset``, ``data_position``,
``reward_fn``, ``rollout``, ``lake``, ...), so ``tasks.rollout`` works on either.

Its progress is only what the lake holds: the next batch is ``max(iteration of the run's train
rows) + 1`` and the data position is the one committed with that batch's rows
(``rollout/data_position_end`` in the commit's rollout stats).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import torch

from buffer import Lake
from infra.config import RunConfig
from rollout.context import rollout_stats_from_commit
from rollout.data import POSITION_METRIC, PromptDataset
from rollout.engine import RolloutEngine, SamplingParams
from trainers.torch_trainer import seed_everything


class RolloutSide:
    """A plain class (not a dataclass) for the reason given on ``Runtime``."""

    def __init__(self, cfg: RunConfig, run_id: str, lake: Lake, engine: RolloutEngine, tokenizer,
                 dataset: PromptDataset, data_position: int = 0) -> None:
        self.cfg, self.run_id, self.lake, self.engine = cfg, run_id, lake, engine
        self.tokenizer, self.dataset, self.data_position = tokenizer, dataset, data_position
        self.reward_fn = self.rollout = None  # set by open_rollout_side
        self.next_batch = 0
        self.reporter = None

    def report(self, event: str, payload: dict) -> None:
        if self.reporter is not None:
            self.reporter(event, payload)

    def sampling(self, greedy: bool = False) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(max_new_tokens=r.rollout_max_response_len,
                              temperature=0.0 if greedy else r.rollout_temperature,
                              top_p=r.rollout_top_p)

    def seed_batch(self, batch: int) -> int:
        """Seed every RNG a batch uses from (seed, batch), as ``Runtime.seed_iteration`` does."""
        from infra.runtime import iteration_seed

        s = iteration_seed(self.cfg.seed, batch)
        seed_everything(s)
        self.engine.generator.manual_seed(s)
        return s

    def load_weights(self, payload: PackedWeights, version: int) -> None:
        """Weights sent by the training side (``pack_weights``) into the engine, as ``version``."""
        self.engine.load_state_dict(unpack_weights(payload), version)


# name -> (dtype name, shape, the tensor's bytes)
PackedWeights = dict[str, tuple[str, tuple[int, ...], bytes]]


def pack_weights(state_dict: dict[str, torch.Tensor]) -> PackedWeights:
    """A state dict as plain bytes for a pipe: no shared memory handles that would outlive a
    killed process. Each tensor's raw bytes, not ``torch.save``: 0.3 ms against 3.3 ms to pack
    and 0.4 against 3.7 to unpack the quickstart's 2 MB model, each iteration, one on each
    side's core (2026-11-28). Tied tensors arrive as copies: the engine copies them in anyway."""
    return {name: (str(t.dtype).removeprefix("torch."), tuple(t.shape),
                   t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            for name, t in state_dict.items()}


def unpack_weights(payload: PackedWeights) -> dict[str, torch.Tensor]:
    """``pack_weights``' state dict back (tensors of their own, writable)."""
    return {name: torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype))
            .reshape(shape) if data else torch.empty(shape, dtype=getattr(torch, dtype))
            for name, (dtype, shape, data) in payload.items()}


def batches_in_lake(lake: Lake, run_id: str) -> list[int]:
    """Iterations (batch numbers) of the run that have train rows in the lake, sorted."""
    rows = lake.read("trajectories", run_id=run_id, columns=["iteration", "kind"])
    train = rows.filter(pc.equal(rows.column("kind"), "train"))
    return sorted(set(train.column("iteration").to_pylist()))


def resume_position(lake: Lake, run_id: str, per_batch: int) -> tuple[int, int]:
    """(next batch, data position) from the lake: after the newest batch with train rows, at the
    position committed with it (``per_batch`` prompts a batch for rows written without it)."""
    done = batches_in_lake(lake, run_id)
    if not done:
        return 0, 0
    last = done[-1]
    stats = rollout_stats_from_commit(lake.trajectory_commit_info(run_id, last)) or {}
    return last + 1, int(stats.get(POSITION_METRIC, (last + 1) * per_batch))


def rollout_model_dir(cfg: RunConfig, run_dir: Path) -> Path:
    """The model folder whose architecture the engine is built on (weights arrive by hand-off):
    ``model.path``, or the tiny base model the training side built (never rebuilt here)."""
    path = Path(cfg.model.path) if cfg.model.path else run_dir / "base_model"
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"rollout side: no HF model at {path} (config.json missing)")
    return path


def open_rollout_side(cfg: RunConfig, run_id: str, version: int) -> RolloutSide:
    """The rollout side of run ``run_id`` in a fresh process, resumed from the lake."""
    from infra.modeling import load_tokenizer
    from infra.runtime import _make_engine
    from rewards.registry import Scorer
    from rollout.runner import Rollout
    from rollout.setup import load_run_data

    run_dir = Path(cfg.home).resolve() / "runs" / run_id
    model_dir = rollout_model_dir(cfg, run_dir)
    tokenizer = load_tokenizer(model_dir)
    dataset, _ = load_run_data(cfg, tokenizer)
    lake = Lake(cfg.resolved_lake_uri, cfg.storage_options or None)
    side = RolloutSide(cfg, run_id, lake, _make_engine(cfg, model_dir, tokenizer, version, run_dir),
                       tokenizer, dataset)
    side.reward_fn, side.rollout = Scorer.from_config(cfg), Rollout(cfg)  # evals: training side
    side.next_batch, side.data_position = resume_position(lake, run_id,
                                                          cfg.rollout.rollout_batch_size)
    return side
