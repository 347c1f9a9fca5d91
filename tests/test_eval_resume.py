"""A sampled evaluation (``eval.greedy: false``) cut short by kill -9, then resumed: the lake's
evaluation samples, its ``evals`` rows, MLflow's ``eval/*`` metrics and the model registry agree
with each other and with a run never interrupted.

The chain crashes twice: right after iteration 1's commit while v2's due checkpoint is being
written (``during_background_write:1``: the resume rebuilds v2 and evaluates it, from other RNG
states than the uninterrupted run had), then once v4's evaluation samples and ``evals`` rows are
in the lake, before its MLflow metrics are logged (``during_evaluation:3``: the resume does not
evaluate v4 again, the lake has it).
Found by a review (2026-11-29): the evaluation drew from whatever state the iteration left, so
a resume evaluated other samples than the uninterrupted run (and, killed between an evaluation's
two appends, wrote ``evals`` rows from samples it did not store); an evaluation's metrics lost
before the tracker's flush were never logged;
v2 was registered with an empty ``checkpoint`` tag although the rebuild wrote it again.
"""

from __future__ import annotations

import signal
from collections import defaultdict

from tests.opshelp import TINY, cli_env, rlake, tail

N_ITER = 4


def _args(home, run_id: str) -> list[str]:
    return ["run", "--set", f"home={home}", "--set", f"run_id={run_id}",
            "--set", f"num_rollout={N_ITER}", "--set", "eval.eval_interval=2",
            "--set", "eval.greedy=false", "--set", "deterministic=true", "--set", "save_interval=2",
            "--set", "rollout.custom_rm_path=tests.opshelp:length_reward", *TINY]


def _evaluations(home, run_id: str) -> tuple[dict, dict, dict]:
    """(eval samples by (version, index): response tokens and reward, evals rows by (version,
    dataset, metric): value, MLflow eval/mean_reward by step)."""
    from mlflow.tracking import MlflowClient

    from buffer import Lake

    lake = Lake(str(home / "lake"))
    rows = lake.read("trajectories", run_id=run_id,
                     columns=["kind", "weight_version", "sample_index", "response_token_ids",
                              "reward"]).to_pylist()
    samples = {(r["weight_version"], r["sample_index"]): (r["response_token_ids"], r["reward"])
               for r in rows if r["kind"] == "eval"}
    evals = {(e["weight_version"], e["dataset"], e["metric"]): e["value"]
             for e in lake.read("evals", run_id=run_id).to_pylist()}
    client = MlflowClient(f"sqlite:///{home}/mlflow/mlflow.db")
    mlflow_run = lake.get_run(run_id)["mlflow_run_id"]
    logged = {m.step: m.value for m in client.get_metric_history(mlflow_run, "eval/mean_reward")}
    return samples, evals, logged


def _checkpoint_tags(home, run_id: str) -> dict[int, str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home}/mlflow/mlflow.db")
    return {int(v.tags["weight_version"]): v.tags["checkpoint"]
            for v in client.search_model_versions(f"name='rlake-{run_id}'")}


def test_a_sampled_evaluation_cut_short_is_resumed_as_an_uninterrupted_run_made_it(tmp_path):
    ref_home, home = tmp_path / "ref", tmp_path / "chain"
    ref_home.mkdir()
    home.mkdir()
    ref = rlake(_args(ref_home, "ref"), cli_env(None), ref_home / "cli.log", background=True)
    crashes = [(_args(home, "chain"), "during_background_write:1"),
               (["resume", "chain", "--home", str(home)], "during_evaluation:3")]
    for k, (args, fault) in enumerate(crashes):
        log = home / f"crash-{k}.log"
        proc = rlake(args, cli_env(None, RLAKE_FAULT=fault), log)
        assert proc.returncode == -signal.SIGKILL, f"{fault}: {tail(log)}"
    done = rlake(["resume", "chain", "--home", str(home)], cli_env(None), home / "final.log")
    assert done.returncode == 0, tail(home / "final.log")
    assert ref.wait(timeout=900) == 0, tail(ref_home / "cli.log")

    samples, evals, logged = _evaluations(home, "chain")
    ref_samples, ref_evals, ref_logged = _evaluations(ref_home, "ref")
    versions = {v for v, _ in ref_samples}
    assert versions == {0, 2, 4}
    # the same samples, so the same metrics, whether or not a crash cut an evaluation short
    assert samples == ref_samples
    assert evals == ref_evals
    rewards = {r for _, r in ref_samples.values()}
    assert len(rewards) > 1, "sampled responses of several lengths: the metrics depend on them"
    # each evals row says what the stored samples say
    by_version = defaultdict(list)
    for (version, _), (_, reward) in samples.items():
        by_version[version].append(reward)
    for version, values in by_version.items():
        assert abs(evals[(version, "held_out", "mean_reward")] - sum(values) / len(values)) < 1e-9
    # MLflow has every evaluation the lake has (logged at the iteration that evaluated it)
    assert logged == ref_logged
    assert sorted(logged.values()) == sorted(v for (_, _, m), v in evals.items() if m == "mean_reward")
    # v2's checkpoint (its write cut short, written again by the rebuild) is registered as saved
    tags, ref_tags = _checkpoint_tags(home, "chain"), _checkpoint_tags(ref_home, "ref")
    assert tags.keys() == ref_tags.keys() == set(range(N_ITER + 1))
    for version, tag in ref_tags.items():
        assert tags[version] == tag.replace(str(ref_home), str(home)).replace("/ref/", "/chain/")
    assert tags[2] == str(home / "runs" / "chain" / "checkpoints" / "v000002")
    assert (home / "runs" / "chain" / "checkpoints" / "v000002").is_dir()
