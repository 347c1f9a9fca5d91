"""Megatron's ranks as Ray actors (trainers/megatron/ray_ranks.py): TP=2 on Ray ranks trains
exactly as TP=2 on spawned processes; a rank that raises or dies stops every rank with a clear
error; a run whose rank dies fails the iteration before its commit and ``rlake resume`` ends it.

One Ray for the module: a single-node ``ray.cluster_utils.Cluster`` on 127.0.0.1 (its own
session folder and random ports, so another test module's Ray beside it does not collide).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from buffer import Lake
from infra.cluster import prepare_ray
from infra.config import ClusterConfig
from tests.megatron_helpers import make_batch, save_tiny_model, trainer_config
from trainers.megatron.launch import SpawnedMegatronTrainer
from trainers.megatron.ranks import RANK_FAULT_ENV, RankDied, RankFailed, parse_rank_fault

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
prepare_ray()  # before anything imports ray: the guard, and 127.0.0.1 as every Ray address
TP2 = dict(tensor_model_parallel_size=2)
STEPS = 2


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    # 4 logical CPUs: the CLI run's engine actor and its two ranks fit on the 2-core machine
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    ray.init(address=c.address, namespace="rlake-test")
    try:
        yield c.address
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    save_tiny_model(str(path), "qwen2", tie=True)  # vocab 31: padded to 32 under TP=2
    return str(path)


def _ray_ranks(ckpt: str, address: str, **cfg):
    from trainers.megatron.ray_ranks import ray_megatron_trainer

    return ray_megatron_trainer(trainer_config(**TP2, **cfg), ckpt, ClusterConfig(
        ray_address=address, placement_timeout_s=300, trainer_call_timeout_s=600), device="cpu")


def _exercise(trainer) -> tuple[torch.Tensor, list[dict], dict]:
    """Log-probs before, the metrics of STEPS train calls, the HF weights after."""
    batch = make_batch(n_groups=2, n_per=4)
    logp = trainer.compute_logprobs(batch)
    metrics = [trainer.train(make_batch(n_groups=2, n_per=4, seed=s)) for s in range(STEPS)]
    return logp, metrics, trainer.hf_state_dict()


def _gone(pids: list[int], within_s: float = 60.0) -> bool:
    """Whether every process in ``pids`` has exited (polled: Ray's kill is asynchronous)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.5)
    return False


def _rank_processes() -> list[int]:
    """Pids of live processes Ray titled as a rank actor (``ray::RankActor...``)."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::RankActor"):
                    out.append(int(entry))
        except (OSError, ValueError):
            continue
    return out


def test_fault_spec_and_when_ranks_are_actors():
    from infra.cluster import megatron_ray_ranks, required_cpus
    from infra.config import load_config
    from trainers.megatron.ray_ranks import rank_gpus

    assert parse_rank_fault("1:2", 1) == 2 and parse_rank_fault("1:2", 0) is None
    assert parse_rank_fault(None, 0) is None
    with pytest.raises(ValueError, match=RANK_FAULT_ENV):
        parse_rank_fault("two", 0)
    mega = ["trainer.backend=megatron", "trainer.tensor_model_parallel_size=2"]
    assert megatron_ray_ranks(load_config(None, mega)) == 0  # no Ray: spawned processes
    assert megatron_ray_ranks(load_config(None, mega[:1] + ["cluster.ray_address=local"])) == 0
    cfg = load_config(None, mega + ["cluster.ray_address=local", "cluster.trainer_num_cpus=1.5"])
    assert megatron_ray_ranks(cfg) == 2
    assert required_cpus(cfg) == 1 + 3  # one engine + 2 ranks x 1.5 (no trainer actor besides)
    assert (rank_gpus("cuda", 0, 2), rank_gpus("cpu", 8, 2)) == (1.0, 0.0)
    assert (rank_gpus("auto", 2, 2), rank_gpus("auto", 1, 2)) == (1.0, 0.0)


def test_ray_ranks_train_as_process_ranks_and_a_raising_rank_stops_all(ckpt, cluster):
    import ray
    from ray.util import placement_group_table

    spawned = SpawnedMegatronTrainer(trainer_config(**TP2), ckpt)
    try:
        want_logp, want_metrics, want_weights = _exercise(spawned)
    finally:
        spawned.close()
    trainer = _ray_ranks(ckpt, cluster)
    ranks = trainer.launcher
    table = placement_group_table(ranks.pg)
    assert trainer.world == 2 and len(table["bundles"]) == 2
    assert all(b == {"CPU": 1.0} for b in table["bundles"].values())  # one bundle per rank, no GPU
    assert [ray.get(a.address.remote())[0] for a in ranks.actors] == ["127.0.0.1"] * 2
    assert len(set(ranks.pids)) == 2 and set(ranks.pids) <= set(_rank_processes())
    logp, metrics, weights = _exercise(trainer)
    assert trainer.weight_version == STEPS
    torch.testing.assert_close(logp, want_logp, atol=1e-6, rtol=0)
    for got, want in zip(metrics, want_metrics, strict=True):
        for k in ("pg_loss", "entropy_loss", "grad_norm"):
            assert got[k] == pytest.approx(want[k], abs=1e-6), k
    assert weights.keys() == want_weights.keys()
    worst = max(float((weights[k] - want_weights[k]).abs().max()) for k in want_weights)
    assert worst <= 1e-6, worst
    # a rank that raises: every rank says why (a traceback), the first answer wins, all stop
    with pytest.raises(RankFailed, match=r"megatron rank [01] failed(.|\n)*Traceback"):
        trainer.load("/nonexistent/checkpoint")
    assert _gone(ranks.pids)
    assert ranks.actors == [] and placement_group_table(ranks.pg)["state"] == "REMOVED"
    with pytest.raises(RankFailed, match="is not running"):
        trainer.train(make_batch())


@pytest.mark.parametrize("launcher", ["ray", "process"])
def test_a_rank_dying_mid_train_stops_every_rank(ckpt, cluster, monkeypatch, launcher):
    monkeypatch.setenv(RANK_FAULT_ENV, "1:2")  # rank 1's process exits in its 2nd train call
    if launcher == "ray":
        trainer = _ray_ranks(ckpt, cluster)
        pids = trainer.launcher.pids
    else:
        trainer = SpawnedMegatronTrainer(trainer_config(**TP2), ckpt)
        pids = [p.pid for p in trainer.launcher._procs]
    try:
        trainer.train(make_batch())
        with pytest.raises(RankDied, match=r"megatron rank 1 died; all ranks stopped, resume"):
            trainer.train(make_batch())
        assert trainer.weight_version == 1
        assert _gone(pids)  # rank 0, stuck in a collective with the dead rank, was stopped too
    finally:
        trainer.close()


def test_a_dead_rank_fails_the_iteration_and_resume_continues(tmp_path, cli, cluster):
    home = tmp_path / "home"
    sets = [f"home={home}", "sft.enabled=false", f"cluster.ray_address={cluster}",
            "trainer.backend=megatron", "trainer.tensor_model_parallel_size=2", "num_rollout=2",
            "eval.eval_interval=100", "data.held_out_size=16", "rollout.rollout_batch_size=4"]
    base = [arg for s in sets for arg in ("--set", s)]
    env = {"PREFECT_HOME": str(home / "prefect")}
    proc = cli(["run", "configs/quickstart.yaml", "--run-id", "deadrank", *base],
               env={**env, RANK_FAULT_ENV: "1:2"}, check=False)
    assert proc.returncode != 0
    assert "megatron rank 1 died; all ranks stopped" in proc.stdout + proc.stderr
    assert "its Ray actor died" in proc.stdout + proc.stderr  # ranks as actors, not processes
    assert _gone(_rank_processes())  # no rank outlives the failed run
    lake = Lake(str(home / "lake"))
    steps = lake.read("train_steps", run_id="deadrank").to_pylist()
    assert [s["iteration"] for s in steps] == [0]  # iteration 1 failed before its commit
    cli(["resume", "deadrank", "--home", str(home)], env=env)
    steps = lake.read("train_steps", run_id="deadrank").to_pylist()
    assert sorted(s["iteration"] for s in steps) == [0, 1]
    assert sorted(s["weight_version"] for s in steps) == [1, 2]
    rows = lake.read("trajectories", run_id="deadrank").to_pylist()
    train = [r for r in rows if r["kind"] == "train"]
    assert len({r["sample_uid"] for r in rows}) == len(rows)  # nothing written twice
    assert len(train) == 2 * 4 * 8
    groups: dict[tuple[int, int], int] = {}
    for r in train:
        groups[(r["iteration"], r["group_index"])] = groups.get((r["iteration"], r["group_index"]), 0) + 1
    assert set(groups.values()) == {8}  # every group whole


def test_a_call_past_its_timeout_stops_every_rank(ckpt, cluster):
    """A rank that does not answer in time (here: any call, given 1 ms) fails the call; the
    ranks, maybe stuck in a collective, are killed rather than waited for."""
    trainer = _ray_ranks(ckpt, cluster)
    pids = trainer.launcher.pids
    trainer.call_timeout_s = 0.001
    with pytest.raises(RankFailed, match=r"a megatron rank timed out(.|\n)*no answer within 0.001s"):
        trainer.train(make_batch())
    assert trainer.weight_version == 0
    assert _gone(pids)
