"""The run's long-lived state: model files, engine, trainer, lake, tracker, data.

Held by the ``rl_run`` flow (never passed through Prefect results). Everything it knows on a
resume it reads back from the lake and the checkpoints, never from memory.
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import torch

from buffer import Lake
from infra.checkpoints import checkpoint_problem, prunable, resume_checkpoint, saved_versions, set_aside
from infra.cluster import megatron_ray_ranks, required_cpus
from infra.config import RunConfig, config_from_dict
from infra.modeling import load_tokenizer, placement, tiny_model, use_deterministic_algorithms
from infra.sides import RolloutSide
from infra.spawned import SpawnedProcess
from infra.startup import new_run_id, not_a_model_folder, open_lake, refuse_existing
from infra.tracker_process import TrackerProcess
from infra.tracking import Tracker
from rollout.data import PromptDataset
from rollout.engine import RolloutEngine, SamplingParams
from rollout.setup import attach_rollout, load_run_data
from trainers.critic import CRITIC_FILE
from trainers.torch_trainer import STATE_FILE, TorchTrainer, seed_everything

RUNTIMES: dict[str, Runtime] = {}
HELD_OUT = "held_out"


def checkpoint_name(version: int) -> str:
    return f"v{version:06d}"


class _OnRolloutSide:
    """A ``Runtime`` attribute that lives on its ``rollout_side`` (one copy of the state)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, objtype=None):
        return self if obj is None else getattr(obj.rollout_side, self.name)

    def __set__(self, obj, value) -> None:
        setattr(obj.rollout_side, self.name, value)


class Runtime:
    """The two sides of a run in one process: its ``rollout_side`` (``infra.sides.RolloutSide``:
    engine, tokenizer, prompt data and position, reward and rollout functions) and the training
    side (trainer, tracker, checkpoints, evaluation), sharing the lake. Async mode runs a second
    rollout side in its own process and keeps this one's engine for evaluation only.

    A plain class on purpose: Prefect walks dataclass task inputs looking for futures, which
    would visit every prompt record and sample on each task call."""

    engine: RolloutEngine | None = _OnRolloutSide()
    tokenizer = _OnRolloutSide()
    dataset: PromptDataset = _OnRolloutSide()
    data_position: int = _OnRolloutSide()
    reward_fn = _OnRolloutSide()
    rollout = _OnRolloutSide()

    def __init__(self, cfg: RunConfig, run_id: str, home: Path, lake: Lake, tracker: Tracker | TrackerProcess,
                 tokenizer, dataset: PromptDataset, held_out: list[dict], reward_fn) -> None:
        self.cfg, self.run_id, self.home, self.lake, self.tracker = cfg, run_id, home, lake, tracker
        self.rollout_side = RolloutSide(cfg, run_id, lake, None, tokenizer, dataset)
        self.held_out, self.reward_fn = held_out, reward_fn
        self.trainer: TorchTrainer | None = None
        self.start_iteration = 0
        self.mlflow_run_id: str | None = None
        self._held_warnings: list[str] = []  # found before anyone listened (``warn``)
        self.reporter = None
        # the previous iteration's commit while it runs behind (a Future: flows.steps.run_behind)
        self.pending_commit = None
        # async mode: the rollout side's process, spawned when the runtime opened, until the
        # run starts the rollout side in it (flows.async_run.RolloutProcess)
        self.spawned: SpawnedProcess | None = None

    def report(self, event: str, payload: dict) -> None:
        """Live progress for the CLI (no-op when nobody listens)."""
        if self.reporter is not None:
            self.reporter(event, payload)

    def warn(self, message: str) -> None:
        """A warning for the CLI; one found while the runtime opens (before the flow sets
        ``reporter``) is held and reported once it is set."""
        if self.reporter is None:
            self._held_warnings.append(message)
        else:
            self.reporter("warning", {"message": message})

    @property
    def reporter(self):
        return self._reporter

    @reporter.setter
    def reporter(self, reporter) -> None:
        self._reporter = reporter
        if reporter is not None:
            held, self._held_warnings = self._held_warnings, []
            for message in held:
                reporter("warning", {"message": message})

    @property
    def run_dir(self) -> Path:
        return self.home / "runs" / self.run_id

    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def checkpoint_dir(self, version: int) -> Path:
        return self.checkpoint_root / checkpoint_name(version)

    def sampling(self, greedy: bool = False) -> SamplingParams:
        return self.rollout_side.sampling(greedy)

    def committed_version(self) -> int:
        """The newest weight version named by a ``train_steps`` row (0 before the first): the
        commit point. A newer checkpoint folder may exist (a crash after the save, before the
        row) and is never trusted."""
        steps = self.lake.read("train_steps", run_id=self.run_id, columns=["weight_version"])
        versions = [v for v in steps.column("weight_version").to_pylist() if v is not None]
        return max(versions, default=0)

    def prune_checkpoints(self, keep_version: int | None = None, committed: int | None = None) -> None:
        """Delete saved versions below the committed one except the newest ``keep_checkpoints``,
        the one a resume needs and v0 while the reference needs it (``infra.checkpoints.
        prunable``). ``keep_version`` is kept too (it is never below the commit). ``committed``:
        the committed version when the caller has just written it (else read from the lake)."""
        committed = self.committed_version() if committed is None else committed
        saved = saved_versions(self.checkpoint_root)
        for v in prunable(saved, committed, self.cfg.keep_checkpoints, self.trainer_needs_v0):
            if v != keep_version:
                shutil.rmtree(self.checkpoint_dir(v), ignore_errors=True)

    @property
    def trainer_needs_v0(self) -> bool:
        """Checkpoint v0 is the frozen KL reference (trainers/reference.py): never prune it."""
        return bool(getattr(self.trainer, "uses_reference", False))

    def latest_checkpoint(self) -> int | None:
        """The newest saved version at or below the committed one (None: none); see
        ``committed_version``."""
        return resume_checkpoint(saved_versions(self.checkpoint_root), self.committed_version())

    def seed_iteration(self, iteration: int) -> int:
        """Seed every RNG an iteration uses from (seed, iteration) alone, so an iteration draws the
        same numbers whether the run was interrupted or not:  s = (seed * 1_000_003 + iteration)
        mod 2**63.  Returns s."""
        return self._seed_all(iteration_seed(self.cfg.seed, iteration))

    def seed_evaluation(self, weight_version: int) -> int:
        """Seed every RNG an evaluation uses from (seed, weight_version) alone, so a sampled
        evaluation (``eval.greedy: false``) of a version draws the same samples whether the run
        was interrupted or not (a resume evaluates again what a crash cut short, and the
        iteration's own draws before it differ after a rebuild):
        s = (iteration_seed(seed, weight_version) + EVAL_SEED_OFFSET) mod 2**63. Returns s.
        The next iteration seeds itself again, so training draws are unchanged."""
        return self._seed_all((iteration_seed(self.cfg.seed, weight_version) + EVAL_SEED_OFFSET) % 2**63)

    def _seed_all(self, s: int) -> int:
        seed_everything(s)
        generator = getattr(self.engine, "generator", None)
        if generator is not None:  # the torch engine samples from its own generator
            generator.manual_seed(s)
        return s


# keeps an evaluation's draws apart from the same-numbered iteration's
EVAL_SEED_OFFSET = 0x5EED_0E7A1


def iteration_seed(seed: int, iteration: int) -> int:
    """(seed * 1_000_003 + iteration) mod 2**63: distinct per (seed, iteration) for small values."""
    return (seed * 1_000_003 + iteration) % 2**63


def _base_model_dir(cfg: RunConfig, run_dir: Path) -> Path:
    if cfg.model.path:
        problem = not_a_model_folder(cfg.model.path)  # checked at start-up too; not from Python
        if problem:
            raise FileNotFoundError(problem)
        return Path(cfg.model.path)
    return tiny_model(run_dir / "base_model", cfg.model.tiny, seed=cfg.seed)


def _make_engine(cfg: RunConfig, model_dir: Path, tokenizer, version: int,
                 run_dir: Path | None = None, pool: bool = True) -> RolloutEngine:
    """The run's rollout engine (over Ray's actors with a cluster, unless not ``pool``); an
    SGLang engine's server logs go to ``run_dir``/logs unless ``rollout.sglang.log_dir`` says
    where."""
    if cfg.rollout.engine == "torch":
        from rollout.torch_engine import TorchEngine, eos_token_ids

        device, dtype = placement(cfg.device, cfg.dtype)
        # every eos of generation_config.json and config.json too (an end of turn), as SGLang does
        eos = eos_token_ids(model_dir, tokenizer.eos_token_id)
        build = partial(TorchEngine, str(model_dir), eos, tokenizer.pad_token_id,
                        weight_version=version, seed=cfg.seed, device=device, dtype=dtype,
                        cuda_graph=cfg.rollout.cuda_graph)
    else:
        from rollout.sglang import SGLangEngine

        build = partial(SGLangEngine.from_config, cfg, str(model_dir), weight_version=version,
                        log_dir=run_dir / "logs" if run_dir is not None else None)
    if cfg.cluster.ray_address is None or not pool:
        return build()
    from rollout.ray_engines import make_engine_pool

    return make_engine_pool(build, cfg, version, required_cpus(cfg))


def _make_trainer(cfg: RunConfig, model_dir: Path, tokenizer, version: int,
                  reference_dir: Path | None = None):
    if megatron_ray_ranks(cfg):  # ranks as Ray actors, driven from this process
        from trainers.megatron.ray_ranks import ray_megatron_trainer

        return ray_megatron_trainer(cfg.trainer, str(model_dir), cfg.cluster, device=cfg.device,
                                    dtype=cfg.dtype, ray_cpus=required_cpus(cfg),
                                    reference_dir=str(reference_dir) if reference_dir else None,
                                    **_megatron_kwargs(cfg, tokenizer, version))
    device, dtype = placement(cfg.device, cfg.dtype)
    if cfg.trainer.backend == "megatron":
        from trainers.megatron.launch import make_megatron_trainer

        build = partial(make_megatron_trainer, cfg.trainer, str(model_dir), dtype=dtype,
                        reference_dir=str(reference_dir) if reference_dir else None,
                        **_megatron_kwargs(cfg, tokenizer, version))
    else:
        build = partial(TorchTrainer, str(model_dir), cfg.trainer, cfg.rollout.n_samples_per_prompt,
                        cfg.rollout.rollout_temperature, weight_version=version,
                        pad_token_id=tokenizer.pad_token_id,
                        reference_dir=str(reference_dir) if reference_dir else None,
                        device=device, dtype=dtype)
    if cfg.cluster.ray_address is None or not cfg.cluster.trainer_on_ray:
        return build()
    from trainers.ray_trainer import RayTrainer

    return RayTrainer(build, cfg.cluster, ray_cpus=required_cpus(cfg))


def _megatron_kwargs(cfg: RunConfig, tokenizer, version: int) -> dict:
    return dict(n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
                rollout_temperature=cfg.rollout.rollout_temperature, weight_version=version,
                pad_token_id=tokenizer.pad_token_id)


def _task_data(cfg: RunConfig, tokenizer) -> tuple[PromptDataset, list[dict]]:
    return load_run_data(cfg, tokenizer)


def open_runtime(cfg: RunConfig, run_id: str | None = None, resume: bool = False,
                 replay: bool = False) -> Runtime:
    """Build (or, with ``resume``, restore from the lake + checkpoints) a run's runtime.
    ``replay``: the runtime of a replay (``flows.replay``), which never generates: no rollout
    process; only such a runtime restores a replay run."""
    home = Path(cfg.home).resolve()
    lake = Lake(cfg.resolved_lake_uri, cfg.storage_options or None)
    if resume:
        row = lake.get_run(run_id)
        if row is None:
            raise ValueError(f"no run '{run_id}' in the lake at {cfg.resolved_lake_uri}")
        if row.get("replay_of") and not replay:
            raise ValueError(f"run '{run_id}' is a replay of '{row['replay_of']}': resume would "
                             "generate; resume it with flows.replay.rl_replay(resume=True) (`rlake resume` does)")
        cfg = recorded_config(row, cfg, home)
    run_id = run_id or cfg.run_id or new_run_id()
    # the run's thread count, whoever calls (the CLI sets it too; `rl_run` from Python or a
    # deployment's worker may not): torch's default, one thread per core, would put two
    # threads on the one core async mode pins the training process to (30x slower, measured)
    torch.set_num_threads(cfg.torch_threads)
    seed_everything(cfg.seed)
    run_dir = home / "runs" / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    # first: MLflow's import and store open in their own process while this one loads the rest
    tracker = TrackerProcess(home)
    # and async mode's rollout process imports while the run starts (infra/spawned.py)
    spawned = SpawnedProcess(home, cfg.torch_threads) if cfg.mode == "async" and not replay else None
    try:
        rt = _open(cfg, run_id, resume, home, run_dir, lake, tracker, row if resume else None)
    except BaseException:
        if spawned is not None:
            spawned.stop()
        tracker.close()
        raise
    rt.spawned = spawned
    RUNTIMES[run_id] = rt
    return rt


def recorded_config(row: dict, cfg: RunConfig, home: Path) -> RunConfig:
    """The config a run was recorded with, at the state folder and lake it is resumed from
    (``cfg``'s: where its row was found): the recorded ``home`` was the path as given then
    (``./rlake-home`` by default, relative), so a resume from another folder, or of a moved
    home, loaded the old base model, wrote MLflow under the old path and failed in async
    mode's rollout process (review, 2026-11-29)."""
    recorded = config_from_dict(json.loads(row["config"]))
    return recorded.model_copy(update={"home": str(home), "lake_uri": cfg.lake_uri,
                                       "storage_options": cfg.storage_options or recorded.storage_options})


def runtime_for(cfg: RunConfig, run_id: str | None, resume: bool, replay: bool = False) -> Runtime:
    """The runtime the CLI opened for ``run_id`` before the first flow (``RUNTIMES``, from
    ``infra.startup.prepared_run`` / ``prepared_replay``, which refuse a run id in use), else
    ``open_runtime`` now; then a new run (not ``resume``) under an id a run already holds is
    refused first, as the CLI refuses it: it would overwrite that run's records."""
    rt = RUNTIMES.get(run_id)
    if rt is not None:
        return rt
    named = run_id or cfg.run_id
    if not resume and named:
        refuse_existing(open_lake(cfg), cfg, named)
    return open_runtime(cfg, run_id, resume=resume, replay=replay)


def _open(cfg: RunConfig, run_id: str, resume: bool, home: Path, run_dir: Path, lake: Lake,
          tracker: TrackerProcess, row: dict | None) -> Runtime:
    base = _base_model_dir(cfg, run_dir)
    tokenizer = load_tokenizer(base)
    dataset, held_out = _task_data(cfg, tokenizer)
    rt = Runtime(cfg=cfg, run_id=run_id, home=home, lake=lake, tracker=tracker,
                 tokenizer=tokenizer, dataset=dataset, held_out=held_out, reward_fn=None)
    attach_rollout(rt)  # rewards, rollout/eval functions, eval sets, data position
    start_version, start_iteration = 0, 0
    model_dir = base
    if cfg.deterministic:
        use_deterministic_algorithms()
    if resume:
        start_iteration, start_version, model_dir = resume_point(rt, base)
        rt.mlflow_run_id = row.get("mlflow_run_id")
    rt.start_iteration = start_iteration
    rt.trainer = _make_trainer(cfg, model_dir, tokenizer, start_version,
                               reference_dir=rt.checkpoint_dir(0))
    if model_dir != base:
        rt.trainer.load(str(model_dir))
    # async mode: the rollout process holds the run's engines (their Ray pool, infra/sides.py);
    # this side's engine only evaluates, in this process (a second pool of num_engines actors
    # needed twice the cluster, and one sized for sync mode could not place it: review,
    # 2026-11-29)
    rt.engine = _make_engine(cfg, model_dir, tokenizer, start_version, run_dir,
                             pool=cfg.mode != "async")
    return rt


def resume_point(rt: Runtime, base: Path, problem=None) -> tuple[int, int, Path]:
    """(next iteration, weight version to load, its model folder) read from the lake.

    Next iteration = max(train_steps.iteration) + 1. Weights = the newest checkpoint at or below
    the committed version (never a newer, uncommitted folder, never a ``*.tmp`` one) whose files
    can be read (``problem``: ``checkpoint_problem`` with the trainer's state files; one that
    cannot is set aside, with a warning, and the next older one taken); the committed steps
    above it are re-trained from the lake afterwards (``flows.durability.rebuild_committed``).
    Before the first commit: v0 if SFT finished (its folder exists; the rename is atomic), else
    the base model (SFT runs again).
    """
    problem = problem or partial(_checkpoint_problem, rt.cfg)
    steps = rt.lake.read("train_steps", run_id=rt.run_id, columns=["iteration", "weight_version"])
    saved = saved_versions(rt.checkpoint_root)
    if not steps.num_rows:
        usable = _usable_checkpoint(rt, [v for v in saved if v == 0], 0, problem)
        return 0, 0, base if usable is None else rt.checkpoint_dir(0)
    start_iteration = max(steps.column("iteration").to_pylist()) + 1
    committed = max(steps.column("weight_version").to_pylist())
    version = _usable_checkpoint(rt, saved, committed, problem)
    if version is None:
        raise FileNotFoundError(f"run {rt.run_id}: no checkpoint at or below the committed weight "
                                f"version {committed} in {rt.checkpoint_root}; cannot resume")
    return start_iteration, version, rt.checkpoint_dir(version)


def _usable_checkpoint(rt: Runtime, saved: list[int], committed: int, problem) -> int | None:
    """The newest of ``saved`` at or below ``committed`` that ``problem`` passes; the newer
    ones it fails are set aside (``set_aside``) with a warning."""
    saved = list(saved)
    while (version := resume_checkpoint(saved, committed)) is not None:
        folder = rt.checkpoint_dir(version)
        why = problem(folder, version)
        if why is None:
            return version
        aside = set_aside(folder)
        rt.warn(f"checkpoint v{version} cannot be resumed from ({why}); set aside as {aside.name}: "
                "the run resumes from an older checkpoint and re-trains the committed steps "
                "from the lake")
        saved.remove(version)
    return None


def _checkpoint_problem(cfg: RunConfig, folder: Path, version: int) -> str | None:
    """``checkpoint_problem`` with what the run's trainer saves besides the weights
    (trainers' ``save``): its optimizer and RNG state, and from v1 on a ppo critic's."""
    if cfg.trainer.backend == "megatron":
        from trainers.megatron.trainer import STATE_DIR

        ranks = sorted(p.name for p in (folder / STATE_DIR).glob("rank*.pt"))
        state = [f"{STATE_DIR}/layout.json", f"{STATE_DIR}/rank0.pt",
                 *(f"{STATE_DIR}/{r}" for r in ranks if r != "rank0.pt")]
    else:
        state = [STATE_FILE]
        if version > 0 and cfg.trainer.loss_type == "policy_loss" \
                and cfg.trainer.advantage_estimator == "ppo":
            state.append(CRITIC_FILE)
    return checkpoint_problem(folder, state)
