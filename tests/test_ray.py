"""Ray: the no-probe guard, the no-Ray default, the engine pool (spread by group, order, weight
versions, an engine dying mid-rollout), the trainer actor, and runs on a two-node cluster.

The two nodes are ``ray.cluster_utils.Cluster`` on 127.0.0.1 (one Ray for the whole module):
the head offers CPUs; the second node also offers the custom resource ``engine_node``, which
the engines ask for (``cluster.engine_resources``), so they can only land there.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from functools import partial

import pytest
import torch

from buffer import Lake
from infra.cluster import bootstrap_path, ensure_bootstrap_guard, prepare_ray
from infra.config import ClusterConfig, ConfigError, load_config
from rollout.engine import SamplingParams
from rollout.ray_engines import ENGINE_FAULT_ENV, engine_seed, group_shares, parse_engine_fault
from tests.conftest import REPO
from tests.learning import EVAL_INTERVAL, LATE_VERSIONS, LEARN_ITERATIONS, assert_learned, paired_gain

ENGINE_RESOURCE = "engine_node"
prepare_ray()  # before anything imports ray: the guard, and 127.0.0.1 as every Ray address


# --- the guard (no Ray started) -------------------------------------------------------------

def test_guard_writes_local_provider_and_keeps_an_existing_one(tmp_path):
    import yaml

    path = ensure_bootstrap_guard(tmp_path / "ray_bootstrap_config.yaml")
    assert yaml.safe_load(path.read_text())["provider"] == {"type": "local"}
    theirs = tmp_path / "theirs.yaml"
    theirs.write_text("cluster_name: prod\nprovider: {type: aws, region: us-west-2}\n")
    ensure_bootstrap_guard(theirs)
    assert "aws" in theirs.read_text()  # a real cluster's file is never rewritten
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster_name: x\n")
    with pytest.raises(RuntimeError, match="provider.type"):
        ensure_bootstrap_guard(bad)


def test_rays_own_code_reads_the_guard_and_never_probes(monkeypatch):
    """Ray's dashboard calls ``get_cluster_config_to_report(expanduser('~/ray_bootstrap_config.yaml'))``;
    with the guard in place that answers 'local' without the metadata requests (made to fail
    loudly here, so a probe would show)."""
    from ray._common.usage import usage_lib
    from ray.dashboard.modules.usage_stats import usage_stats_head

    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    assert os.environ["RAY_USAGE_STATS_REPORT_URL"].startswith("http://127.0.0.1:")
    from ray._private import services

    assert services.get_node_ip_address() == "127.0.0.1"
    assert 'os.path.expanduser("~/ray_bootstrap_config.yaml")' in inspect.getsource(usage_stats_head)
    assert str(bootstrap_path()) == os.path.expanduser("~/ray_bootstrap_config.yaml")

    def probe():
        raise AssertionError("Ray asked the cloud-metadata addresses")

    monkeypatch.setattr(usage_lib, "get_cloud_from_metadata_requests", probe)
    assert usage_lib.get_cluster_config_to_report(str(bootstrap_path())).cloud_provider == "local"


def test_config_keys_and_errors():
    with pytest.raises(ConfigError, match=r"rollout.num_engines=2 needs Ray: set cluster.ray_address"):
        load_config(None, ["rollout.num_engines=2"])
    with pytest.raises(ConfigError, match="cluster.placement_strategy"):
        load_config(None, ["cluster.ray_address=local", "cluster.placement_strategy=RANDOM"])
    cfg = load_config(None, ["cluster.ray_address=local", "rollout.num_engines=3",
                             "rollout.num_cpus_per_engine=0.5", "cluster.engine_resources={gpu_box: 1}"])
    assert (cfg.rollout.num_engines, cfg.cluster.engine_resources) == (3, {"gpu_box": 1.0})
    assert load_config(None).cluster.ray_address is None


@pytest.mark.parametrize("overrides, message", [
    (["cluster.ray_address=foo"], r"'cluster.ray_address': must be null \(no Ray\), 'local', or a cluster address HOST:PORT"),
    (["cluster.ray_address=LOCAL"], r"'cluster.ray_address'"),
    (["cluster.ray_address=127.0.0.1"], r"'cluster.ray_address'"),
    (["cluster.ray_address=10.0.0.1:70000"], r"'cluster.ray_address'"),
    (["cluster.ray_address=local", "cluster.trainer_num_cpus=0"], r"the trainer actor needs some resource: cluster.trainer_num_cpus"),
    (["cluster.ray_address=local", "rollout.num_cpus_per_engine=0"], r"an engine actor needs some resource: rollout.num_cpus_per_engine"),
    (["cluster.ray_address=local", "cluster.engine_resources={x: -1}"], r"'cluster.engine_resources': 'x': -1.0 is not a non-negative amount"),
    (["cluster.ray_address=local", "cluster.engine_resources={CPU: 1}"], r"'CPU' is not a custom resource: set rollout.num_cpus_per_engine"),
])
def test_cluster_values_ray_cannot_take_are_refused_naming_the_key(overrides, message):
    """Each was accepted and failed at start, after the run was recorded, in Ray's words
    ("Invalid address format", "Bundles cannot be an empty dictionary", ...: review, 2026-11-29)."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_cluster_addresses_ray_takes_are_accepted():
    for address in ("local", "10.0.0.1:6379", "head.example.org:6379", "ray://10.0.0.1:10001"):
        assert load_config(None, [f"cluster.ray_address={address}"]).cluster.ray_address == address
    cfg = load_config(None, ["cluster.ray_address=local", "rollout.num_cpus_per_engine=0",
                             "cluster.engine_resources={gpu_box: 1}", "cluster.trainer_on_ray=false",
                             "cluster.trainer_num_cpus=0"])
    assert cfg.rollout.num_cpus_per_engine == 0 and cfg.cluster.trainer_num_cpus == 0


def test_no_ray_by_default(tiny):
    """ray_address null: engine and trainer are built in process, and Ray is never imported."""
    path, _ = tiny
    code = f"""
import sys
from infra.config import load_config
from infra.modeling import load_tokenizer
from infra.runtime import _make_engine, _make_trainer
import flows.rl
cfg = load_config(None)
tok = load_tokenizer({str(path)!r})
engine, trainer = _make_engine(cfg, {str(path)!r}, tok, 0), _make_trainer(cfg, {str(path)!r}, tok, 0)
print(type(engine).__name__, type(trainer).__name__, "ray" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    assert out.stdout.split()[-3:] == ["TorchEngine", "TorchTrainer", "False"], out.stderr[-2000:]


def test_group_shares_keep_groups_whole_and_cover_in_order():
    for n, g, e in [(32, 8, 2), (24, 8, 5), (7, 3, 2), (8, 8, 3), (40, 4, 3)]:
        shares = group_shares(n, g, e)
        assert len(shares) == e
        flat = [i for a, b in shares for i in range(a, b)]
        assert flat == list(range(n))  # every prompt once, in order
        assert all(a % g == 0 for a, b in shares if b > a)  # a share starts at a group
        sizes = [(b - a + g - 1) // g for a, b in shares]
        assert max(sizes) - min(sizes) <= 1  # balanced to one group
    assert engine_seed(5, 0, 0) != engine_seed(5, 1, 0) != engine_seed(5, 1, 1)
    assert parse_engine_fault("1:2", 1) == 2 and parse_engine_fault("1:2", 0) is None
    with pytest.raises(ValueError, match=ENGINE_FAULT_ENV):
        parse_engine_fault("one", 0)


# --- one two-node Ray for the rest of the module ----------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    # 4 logical CPUs: the two engines fit there even when the trainer actor lands there too
    node2 = c.add_node(num_cpus=4, node_ip_address="127.0.0.1", resources={ENGINE_RESOURCE: 2})
    c.wait_for_nodes()
    assert c.address.startswith("127.0.0.1:"), c.address
    ray.init(address=c.address, namespace="rlake-test")
    try:
        yield {"address": c.address, "engine_node": node2.node_id, "head": c.head_node.node_id}
    finally:
        ray.shutdown()
        c.shutdown()


def _pool(tiny, cluster, n=2, group=4, **kw):
    from rollout.ray_engines import RayStateDictEnginePool
    from rollout.torch_engine import TorchEngine

    path, tok = tiny
    cfg = ClusterConfig(ray_address=cluster["address"], engine_resources={ENGINE_RESOURCE: 1},
                        max_engine_restarts=2, placement_timeout_s=300)
    build = partial(TorchEngine, str(path), tok.eos_token_id, tok.pad_token_id)
    return RayStateDictEnginePool(build, "torch", n, group, cfg, 0, **kw)


def _local_engine(tiny):
    from rollout.torch_engine import TorchEngine

    path, tok = tiny
    return TorchEngine(str(path), tok.eos_token_id, tok.pad_token_id)


PROMPTS = [[1 + (i // 4) % 9, 2 + i % 5, 3] for i in range(24)]  # 6 groups of 4
SAMPLING = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1234)


def test_pool_spreads_by_group_on_the_engine_node_and_keeps_order(tiny, cluster):
    pool = _pool(tiny, cluster)
    try:
        assert {p["node_id"] for p in pool.placement} == {cluster["engine_node"]}
        results = pool.generate(PROMPTS, SAMPLING)
        names = [r.meta["engine"] for r in results]
        assert names == ["ray:torch/0"] * 12 + ["ray:torch/1"] * 12
        # each share is exactly what one engine makes of those prompts with that engine's seed
        local = _local_engine(tiny)
        for k, (a, b) in enumerate(group_shares(len(PROMPTS), 4, 2)):
            want = local.generate(PROMPTS[a:b], SamplingParams(6, 1.0, seed=engine_seed(1234, k, 0)))
            assert [r.token_ids for r in results[a:b]] == [w.token_ids for w in want]
    finally:
        pool.shutdown()


def test_every_engine_serves_each_weight_version(tiny, cluster):
    pool = _pool(tiny, cluster)
    try:
        assert pool.engine_versions() == [0, 0]
        local = _local_engine(tiny)
        weights = {k: v + 0.05 * torch.randn_like(v) for k, v in local.model.state_dict().items()}
        pool.load_state_dict(weights, 7)
        assert pool.weight_version == 7 and pool.engine_versions() == [7, 7]
        local.load_state_dict(weights, 7)
        results = pool.generate(PROMPTS, SAMPLING)
        for k, (a, b) in enumerate(group_shares(len(PROMPTS), 4, 2)):
            want = local.generate(PROMPTS[a:b], SamplingParams(6, 1.0, seed=engine_seed(1234, k, 0)))
            assert [r.token_ids for r in results[a:b]] == [w.token_ids for w in want]
    finally:
        pool.shutdown()


def test_an_engine_dying_mid_rollout_loses_and_duplicates_nothing(tiny, cluster, monkeypatch):
    monkeypatch.setenv(ENGINE_FAULT_ENV, "1:2")  # engine 1's process exits in its 2nd generate
    pool = _pool(tiny, cluster)
    try:
        local = _local_engine(tiny)
        weights = {k: v + 0.05 * torch.randn_like(v) for k, v in local.model.state_dict().items()}
        pool.load_state_dict(weights, 3)
        assert [r.meta["engine"] for r in pool.generate(PROMPTS, SAMPLING)][-1] == "ray:torch/1"
        first_pid = pool.placement[1]["pid"]
        results = pool.generate(PROMPTS, SAMPLING)  # engine 1 dies; its groups go to engine 0
        assert len(results) == len(PROMPTS) and all(r is not None for r in results)
        assert {r.meta["engine"] for r in results} == {"ray:torch/0"}
        for a in range(0, len(PROMPTS), 4):
            assert len({r.meta["engine"] for r in results[a:a + 4]}) == 1  # groups stay whole
        # Ray restarted engine 1 (a new process); it gets version 3 again before it serves
        results = pool.generate(PROMPTS, SAMPLING)
        assert [r.meta["engine"] for r in results][-1] == "ray:torch/1"
        assert pool.engine_versions() == [3, 3]
        import ray

        assert ray.get(pool.actors[1].ready.remote())["pid"] != first_pid
    finally:
        pool.shutdown()


def test_trainer_actor_trains_and_a_dead_one_fails_cleanly(tiny, cluster, monkeypatch):
    from infra.config import TrainerConfig
    from trainers.base import TrainBatch
    from trainers.ray_trainer import RayTrainer, TrainerActorDied
    from trainers.torch_trainer import TorchTrainer

    path, tok = tiny
    monkeypatch.setenv("RLAKE_TRAINER_FAULT", "2")  # its process exits in its 2nd train call
    build = partial(TorchTrainer, str(path), TrainerConfig(global_batch_size=4, micro_batch_size=4),
                    2, 1.0, weight_version=0, pad_token_id=tok.pad_token_id)
    trainer = RayTrainer(build, ClusterConfig(ray_address=cluster["address"], placement_timeout_s=300))
    batch = TrainBatch(sample_uids=["a", "b", "c", "d"], prompt_token_ids=[[1, 2]] * 4,
                       response_token_ids=[[3, 4], [4], [3], [5, 6]], loss_mask=[[]] * 4,
                       rollout_logprobs=[[]] * 4, rewards=[1.0, 0.0, 1.0, 0.0],
                       group_keys=["g0", "g0", "g1", "g1"], weight_versions=[0] * 4)
    try:
        before = {k: v.clone() for k, v in trainer.state_dict().items()}
        metrics = trainer.train(batch)
        assert trainer.weight_version == 1 and "pg_loss" in metrics
        after = trainer.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)  # real gradient steps
        assert trainer.uses_reference in (True, False)  # forwarded attribute, not run locally
        with pytest.raises(TrainerActorDied, match="rlake resume"):
            trainer.train(batch)
    finally:
        trainer.close()


# --- runs through the CLI, joining the two-node cluster ---------------------------------------

def _lake_invariants(lake: Lake, run_id: str) -> list[dict]:
    rows = lake.read("trajectories", run_id=run_id).to_pylist()
    uids = [r["sample_uid"] for r in rows]
    assert len(uids) == len(set(uids))
    train = [r for r in rows if r["kind"] == "train"]
    groups: dict[tuple[int, int], int] = {}
    for r in train:
        groups[(r["iteration"], r["group_index"])] = groups.get((r["iteration"], r["group_index"]), 0) + 1
    assert set(groups.values()) == {8}, groups  # every group complete (n_samples_per_prompt)
    return train


@pytest.mark.slow
def test_a_dead_trainer_actor_fails_the_iteration_and_resume_continues(tmp_path, cli, cluster):
    home = tmp_path / "home"
    base = ["--set", f"home={home}", "--set", "sft.enabled=false", "--set", f"cluster.ray_address={cluster['address']}",
            "--set", "num_rollout=3", "--set", "eval.eval_interval=100",
            "--set", "rollout.rollout_batch_size=8"]
    env = {"PREFECT_HOME": str(home / "prefect")}
    proc = cli(["run", "configs/quickstart.yaml", "--run-id", "deadtrainer", *base],
               env={**env, "RLAKE_TRAINER_FAULT": "2"}, check=False)
    assert proc.returncode != 0
    assert "trainer actor died" in proc.stdout + proc.stderr
    lake = Lake(str(home / "lake"))
    steps = lake.read("train_steps", run_id="deadtrainer").to_pylist()
    assert [s["iteration"] for s in steps] == [0]  # iteration 1 failed before its commit
    cli(["resume", "deadtrainer", "--home", str(home)], env=env)
    steps = lake.read("train_steps", run_id="deadtrainer").to_pylist()
    assert sorted(s["iteration"] for s in steps) == [0, 1, 2]
    assert sorted(s["weight_version"] for s in steps) == [1, 2, 3]
    train = [r for r in lake.read("trajectories", run_id="deadtrainer").to_pylist() if r["kind"] == "train"]
    assert len({r["sample_uid"] for r in train}) == len(train) == 3 * 8 * 8
    assert json.loads(lake.get_run("deadtrainer")["config"])["cluster"]["ray_address"] == cluster["address"]


@pytest.mark.slow
def test_two_engines_on_the_second_node_learn_through_an_engine_death(tmp_path, cli, cluster,
                                                                      warm_model):
    """The quickstart from the shared SFT warm-up, 2 engine actors on the engine node, one of
    them killed in its 3rd call (mid-rollout of iteration 1): the run completes, the lake holds
    every group once, and held-out accuracy rises beyond noise."""
    home, iterations = tmp_path / "home", LEARN_ITERATIONS  # tests/learning.py: why 100
    args = ["run", "configs/quickstart.yaml"]
    for s in [f"home={home}", "run_id=ray2", f"num_rollout={iterations}",
              f"eval.eval_interval={EVAL_INTERVAL}", f"model.path={warm_model['checkpoint']}",
              "sft.enabled=false", f"cluster.ray_address={cluster['address']}",
              "rollout.num_engines=2", f"cluster.engine_resources={{{ENGINE_RESOURCE}: 1}}"]:
        args += ["--set", s]
    cli(args, env={"PREFECT_HOME": str(home / "prefect"), ENGINE_FAULT_ENV: "1:3"})
    lake = Lake(str(home / "lake"))
    train = _lake_invariants(lake, "ray2")
    assert len(train) == iterations * 32 * 8
    by_iteration: dict[int, set[str]] = {}
    for r in train:
        by_iteration.setdefault(r["iteration"], set()).add(r["engine"])
    assert by_iteration[0] == {"ray:torch/0", "ray:torch/1"}
    assert by_iteration[1] == {"ray:torch/0"}  # engine 1 died in its 3rd call (iteration 1)
    assert by_iteration[iterations - 1] == {"ray:torch/0", "ray:torch/1"}  # restarted, serving
    evals = lake.read("evals", run_id="ray2").to_pylist()
    acc = {e["weight_version"]: e["value"] for e in evals if e["metric"] == "accuracy"}
    assert set(acc) == set(range(0, iterations + 1, EVAL_INTERVAL)), acc
    one = paired_gain(lake, "ray2", 0, iterations)[0]
    assert one == pytest.approx(acc[iterations] - acc[0])  # the same problems the evals row scored
    assert_learned(lake, "ray2", 0, LATE_VERSIONS)  # >= 3 SE; 40 iterations: 0.588 -> 0.690 (Intel), 0.632 -> 0.624 (AMD)


@pytest.mark.slow
def test_async_mode_places_one_pool_of_engines(tmp_path, cli, cluster):
    """Async mode: the rollout process holds the run's engine actors and the training side
    evaluates in its own process. It built a second pool of ``num_engines`` actors for its
    evaluations, which a cluster with room for one pool could not place (review, 2026-11-29):
    here the engine node has room for exactly the two engines."""
    home = tmp_path / "home"
    args = ["run", "configs/quickstart.yaml", "--run-id", "async2"]
    for s in [f"home={home}", "sft.steps=20", "sft.stop_at_accuracy=null", "num_rollout=3",
              "eval.eval_interval=2", "data.held_out_size=20", "rollout.rollout_batch_size=8",
              "mode=async", "trainer.max_staleness=1", f"cluster.ray_address={cluster['address']}",
              "rollout.num_engines=2", f"cluster.engine_resources={{{ENGINE_RESOURCE}: 1}}",
              "cluster.placement_timeout_s=60"]:
        args += ["--set", s]
    cli(args, env={"PREFECT_HOME": str(home / "prefect")})
    lake = Lake(str(home / "lake"))
    train = _lake_invariants(lake, "async2")
    assert len(train) == 3 * 8 * 8
    assert {r["engine"] for r in train} == {"ray:torch/0", "ray:torch/1"}
    evals = lake.read("evals", run_id="async2").to_pylist()
    assert {e["weight_version"] for e in evals if e["metric"] == "accuracy"} == {0, 2, 3}
