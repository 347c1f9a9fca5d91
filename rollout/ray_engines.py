"""N rollout engines as Ray actors behind the one-engine interface (``RolloutEngine``).

``RayEnginePool.generate`` cuts the prompt list into groups of ``group_size`` consecutive
prompts (the ``n_samples_per_prompt`` samples of one GRPO group), gives each engine a contiguous
share of whole groups, and puts the answers back in the caller's order. Each answer's
``meta["engine"]`` names the engine that made it (``ray:torch/1``); ``generate_samples`` stores it
on the sample, and the lake's ``engine`` column gets it.

Weights: ``load_state_dict`` puts the state dict into Ray's object store once and every engine
reads it from there; ``update_weights`` hands every engine a checkpoint folder (it must be
reachable from every node). The pool's ``weight_version`` is the version every live engine has
acknowledged; ``engine_versions`` asks each engine what it serves.

Faults: engine actors restart (``max_restarts``) when their process dies. The share of a call
that died is split over the other live engines (by group again) and re-sent, so each prompt is
answered exactly once; a restarted engine gets the current weights before its next call.

Timeouts: every wait on an engine is bounded by ``cluster.engine_call_timeout_s`` (a generate
call, a weight hand-off, a version query, a restarted engine's weights; an engine's start-up,
i.e. building its model, counts as one call too). An engine that does not answer in time (a hung
process is not a dead one: Ray does not restart it) fails the call with one ``TimeoutError``
naming the engine and the key; the pool never waits forever. A hand-off that timed out leaves
the engine stale (it gets the weights again before it serves) and the pool's version unchanged.

Seeds: a call draws one base seed from ``generator`` (reseeded per iteration by the runtime) or
takes ``sampling.seed``; engine k samples with ``engine_seed(base, k, attempt)``. A run is thus
reproducible for a given number of engines when no engine dies; a re-sent share is sampled
afresh (another engine, another seed).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from infra.cluster import actor_options, bundle, connect, placement_group
from infra.config import ClusterConfig, RunConfig
from infra.faults import parse_member_fault
from rollout.engine import GenerationResult, RolloutEngine, SamplingParams

ENGINE_FAULT_ENV = "RLAKE_ENGINE_FAULT"  # "k:n": engine k's first process exits in its n-th generate


def group_shares(n_prompts: int, group_size: int, n_engines: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) shares of whole groups: with U = ceil(n / g) groups, engine k
    gets groups [floor(k U / E), floor((k+1) U / E)), i.e. prompts [g * that, ...) clipped to n.
    Shares may be empty (fewer groups than engines)."""
    units = -(-n_prompts // group_size)
    out = []
    for k in range(n_engines):
        a, b = (k * units) // n_engines, ((k + 1) * units) // n_engines
        out.append((min(a * group_size, n_prompts), min(b * group_size, n_prompts)))
    return out


def engine_seed(base: int, engine: int, attempt: int) -> int:
    """(base * 1_000_003 + 1_009 * attempt + engine) mod 2**63: one stream per (call, engine,
    attempt)."""
    return (base * 1_000_003 + 1_009 * attempt + engine) % 2**63


def parse_engine_fault(spec: str | None, index: int) -> int | None:
    """``"k:n"`` -> n when k == index (this engine dies in its n-th generate call), else None."""
    return parse_member_fault(spec, index, ENGINE_FAULT_ENV, "engine")


class EngineWorker:
    """One engine inside a Ray actor (1 torch thread)."""

    def __init__(self, index: int, name: str, build: Callable[[], RolloutEngine]) -> None:
        import ray

        torch.set_num_threads(1)
        self.index, self.name = index, name
        self.engine = build()
        self.calls = 0
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.die_at = None if restarted else parse_engine_fault(os.environ.get(ENGINE_FAULT_ENV), index)

    def ready(self) -> dict[str, Any]:
        import ray

        return {"weight_version": self.engine.weight_version, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def weight_version(self) -> int:
        return self.engine.weight_version

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[GenerationResult]:
        self.calls += 1
        if self.die_at == self.calls:
            os._exit(1)  # fault injection: the process dies mid-rollout, as a crash would
        results = self.engine.generate(prompts, sampling)
        for r in results:
            r.meta = {**r.meta, "engine": self.name}
        return results

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], weight_version: int) -> int:
        self.engine.load_state_dict(state_dict, weight_version)
        return weight_version

    def update_weights(self, checkpoint_dir: str, weight_version: int) -> int:
        self.engine.update_weights(checkpoint_dir, weight_version)
        return weight_version

    def shutdown(self) -> None:
        self.engine.shutdown()


class RayEnginePool:
    """``RolloutEngine`` over N ``EngineWorker`` actors on one placement group."""

    def __init__(self, build: Callable[[], RolloutEngine], engine_name: str, num_engines: int,
                 group_size: int, cluster: ClusterConfig, weight_version: int, num_cpus: float = 1.0, num_gpus: float = 0.0,
                 seed: int = 0, ray_cpus: int | None = None) -> None:
        self.name = f"ray:{engine_name}"
        self.connection = connect(cluster, self.name, num_cpus=ray_cpus)
        import ray

        self.group_size = group_size
        self.cluster = cluster
        self.generator = torch.Generator().manual_seed(seed)
        self._version = weight_version
        self._weights: tuple[str, Any, int] | None = None
        self._stale: set[int] = set()
        self._failures = [0] * num_engines
        self.pg = placement_group([bundle(num_cpus, num_gpus, cluster.engine_resources)] * num_engines,
                                  cluster.placement_strategy, f"rollout.num_engines={num_engines}",
                                  cluster.placement_timeout_s)
        fault = os.environ.get(ENGINE_FAULT_ENV)
        env = {"runtime_env": {"env_vars": {ENGINE_FAULT_ENV: fault}}} if fault else {}
        remote = ray.remote(EngineWorker)
        self.names = [f"{self.name}/{k}" for k in range(num_engines)]
        self.actors = [remote.options(**actor_options(
            self.pg, k, num_cpus, num_gpus, cluster.engine_resources,
            max_restarts=cluster.max_engine_restarts, max_task_retries=0, **env)).remote(k, self.names[k], build)
            for k in range(num_engines)]
        self.alive = [True] * num_engines
        try:
            self.placement = self._gather({k: a.ready.remote() for k, a in enumerate(self.actors)},
                                          "start-up (building its engine)")
        except BaseException:
            self.shutdown()  # no half-started pool: its actors and placement group go too
            raise

    @property
    def weight_version(self) -> int:
        return self._version

    def _timeout_error(self, keys: list[int], what: str) -> TimeoutError:
        names = ", ".join(self.names[k] for k in keys)
        return TimeoutError(f"{names}: no answer to {what} within "
                            f"cluster.engine_call_timeout_s={self.cluster.engine_call_timeout_s:g}")

    def _get(self, k: int, ref: Any, what: str, deadline: float | None = None) -> Any:
        """``ray.get`` of engine ``k``'s call, bounded by ``cluster.engine_call_timeout_s`` (or what
        is left of ``deadline``); past it one ``TimeoutError`` naming the engine and the key.
        ``RayActorError`` (the engine died) passes through."""
        import ray

        if deadline is None:
            deadline = time.monotonic() + self.cluster.engine_call_timeout_s
        try:
            return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            raise self._timeout_error([k], what) from None

    def _gather(self, refs: dict[int, Any], what: str) -> list[Any]:
        """Every answer of ``refs`` (engine -> ref) within one ``engine_call_timeout_s``; a
        ``TimeoutError`` naming every engine that did not answer."""
        import ray

        _, pending = ray.wait(list(refs.values()), num_returns=len(refs),
                                  timeout=self.cluster.engine_call_timeout_s)
        if pending:
            late = set(pending)
            raise self._timeout_error([k for k, r in refs.items() if r in late], what)
        return ray.get(list(refs.values()))

    def engine_versions(self) -> list[int | None]:
        """The weight version each engine serves now (None: dead); an engine that does not
        answer within ``cluster.engine_call_timeout_s`` raises ``TimeoutError``."""
        import ray

        refs = {k: a.weight_version.remote() for k, a in enumerate(self.actors) if self.alive[k]}
        deadline = time.monotonic() + self.cluster.engine_call_timeout_s
        out: list[int | None] = []
        for k in range(len(self.actors)):
            try:
                out.append(self._get(k, refs[k], "weight_version", deadline) if k in refs else None)
            except ray.exceptions.RayActorError:
                out.append(None)
        return out

    def live(self) -> list[int]:
        return [k for k, ok in enumerate(self.alive) if ok]

    def update_weights(self, checkpoint_dir: str, weight_version: int) -> None:
        self._weights = ("path", checkpoint_dir, weight_version)
        self._broadcast()

    def _broadcast(self) -> None:
        import ray

        refs = {k: self._push(k) for k in self.live()}
        what = self._handoff_name()
        deadline = time.monotonic() + self.cluster.engine_call_timeout_s
        for k, ref in refs.items():
            try:
                self._get(k, ref, what, deadline)
                self._stale.discard(k)
            except ray.exceptions.RayActorError:
                self._stale.add(k)  # it restarts with its first weights: resent before its next call
            except TimeoutError:
                # a hung engine: the hand-off fails (as a generate call past the timeout does);
                # it and those not yet confirmed get the weights again before they serve
                self._stale.update(j for j in refs if j >= k)
                raise
        self._version = self._weights[2]

    def _handoff_name(self) -> str:
        kind, _, version = self._weights
        return f"{'load_state_dict' if kind == 'state' else 'update_weights'} (weight_version {version})"

    def _push(self, k: int) -> Any:
        kind, payload, version = self._weights
        method = self.actors[k].load_state_dict if kind == "state" else self.actors[k].update_weights
        return method.remote(payload, version)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[GenerationResult]:
        import ray

        if not prompts:
            return []
        base = sampling.seed if sampling.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self.generator))
        results: list[GenerationResult | None] = [None] * len(prompts)
        inflight: dict[Any, tuple[int, int, int, int]] = {}

        def send(start: int, stop: int, attempt: int, exclude: int | None = None) -> None:
            engines = [k for k in self.live() if k != exclude and (k not in self._stale or self._revive(k))]
            if not engines and exclude is not None and self.alive[exclude] and self._revive(exclude):
                engines = [exclude]
            if not engines:
                raise RuntimeError(f"{self.name}: every engine actor is dead (restarts exhausted)")
            for k, (a, b) in zip(engines, group_shares(stop - start, self.group_size, len(engines)),
                                 strict=True):
                if b > a:
                    seed = engine_seed(base, k, attempt)
                    ref = self.actors[k].generate.remote(prompts[start + a:start + b],
                                                         replace(sampling, seed=seed))
                    inflight[ref] = (k, start + a, start + b, attempt)

        send(0, len(prompts), 0)
        while inflight:
            ready, _ = ray.wait(list(inflight), num_returns=1,
                                timeout=self.cluster.engine_call_timeout_s)
            if not ready:
                raise self._timeout_error(sorted({v[0] for v in inflight.values()}), "generate")
            k, a, b, attempt = inflight.pop(ready[0])
            try:
                results[a:b] = ray.get(ready[0])
                self._failures[k] = 0
            except ray.exceptions.RayActorError:
                self._engine_failed(k)
                send(a, b, attempt + 1, exclude=k)
        return results  # type: ignore[return-value]

    def _revive(self, k: int) -> bool:
        """Wait for a failed engine's restart (calls to an actor Ray is restarting fail), then
        give it the current weights; False (and the engine is out) if it does not come back
        within ``cluster.placement_timeout_s``. An engine that is back but does not take the
        weights within ``cluster.engine_call_timeout_s`` raises ``TimeoutError`` (it stays stale)."""
        import ray

        deadline = time.monotonic() + self.cluster.placement_timeout_s
        while time.monotonic() < deadline:
            try:
                ray.get(self.actors[k].ready.remote(),
                        timeout=max(0.0, deadline - time.monotonic()))
                if self._weights is not None:
                    self._get(k, self._push(k), self._handoff_name())
                self._stale.discard(k)
                return True
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                time.sleep(0.5)
        self.alive[k] = False
        return False

    def _engine_failed(self, k: int) -> None:
        """Count a failed call; past ``max_engine_restarts + 1`` in a row the engine is out."""
        self._failures[k] += 1
        self._stale.add(k)
        if self._failures[k] > self.cluster.max_engine_restarts:
            self.alive[k] = False

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(self.pg)
        self.actors = []
        self.connection.release(self.name)


class RayStateDictEnginePool(RayEnginePool):
    """A pool of engines that take weights as a state dict (torch): one ``ray.put``, N reads."""

    def load_state_dict(self, state_dict: dict[str, torch.Tensor] | Any, weight_version: int) -> None:
        """``state_dict`` may already be an ObjectRef (a trainer actor's), sent as is."""
        import ray

        ref = state_dict if isinstance(state_dict, ray.ObjectRef) else ray.put(state_dict)
        self._weights = ("state", ref, weight_version)
        self._broadcast()


def make_engine_pool(build: Callable[[], RolloutEngine], cfg: RunConfig, weight_version: int,
                     ray_cpus: int | None = None) -> RayEnginePool:
    """The pool ``cfg`` asks for: torch engines take state dicts through the object store,
    others (SGLang) a checkpoint folder."""
    r = cfg.rollout
    cls = RayStateDictEnginePool if r.engine == "torch" else RayEnginePool
    return cls(build, r.engine, r.num_engines, r.n_samples_per_prompt, cfg.cluster, weight_version,
               num_cpus=r.num_cpus_per_engine, num_gpus=r.rollout_num_gpus_per_engine,
               seed=cfg.seed, ray_cpus=ray_cpus)
