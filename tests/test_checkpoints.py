"""Checkpoints every ``save_interval``, written in the background, with the lake as write-ahead log.

Unit part: the checkpoint rules (infra/checkpoints.py) and the background writer
(trainers/checkpoint.py). End-to-end part (the real CLI in subprocesses, one shared Prefect
server): with ``num_rollout=5, save_interval=3`` an uninterrupted run keeps v0, v3, v5 only; a
run killed after a commit between saves, and one killed while its checkpoint is half-written in
the background, both resume by re-training the committed steps from the lake (no generation) and
end bitwise equal (weights and optimizer state) to the uninterrupted run; a replay starting at a
version with no checkpoint rebuilds it the same way.
"""

from __future__ import annotations

import errno
import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from infra.checkpoints import checkpoint_due, prunable, rebuild_chain, saved_versions, stale_folders
from infra.recovery import run_tag
from tests.opshelp import TINY, cli_env, rlake, shared_prefect_server, tail
from tests.trainer_fixtures import build_model, make_batch, params, trainer
from trainers.checkpoint import CheckpointWriteError, CheckpointWriter, Snapshot, cpu_copy, write_snapshot
from trainers.torch_trainer import STATE_FILE

REWARDS = [1.0, 0.0, 0.5, 0.25]


# ---- the rules ----
def test_checkpoint_due_every_interval_and_at_the_end():
    due = [i + 1 for i in range(10) if checkpoint_due(i, 10, 4)]
    assert due == [4, 8, 10]
    assert [i + 1 for i in range(3) if checkpoint_due(i, 3, 1)] == [1, 2, 3]


def test_prunable_keeps_newest_the_resume_one_and_v0_for_the_reference():
    saved = [0, 3, 6, 9]
    # committed 8: a resume needs v6; v9 is newer than the commit (never deleted)
    assert prunable(saved, 8, 1, keep_v0=False) == [0, 3]
    assert prunable(saved, 8, 1, keep_v0=True) == [3]
    assert prunable(saved, 9, 2, keep_v0=False) == [0, 3]
    assert prunable([0], 0, 1, keep_v0=False) == []


def test_saved_versions_and_stale_folders_ignore_tmp(tmp_path):
    for name in ("v000000", "v000003", "v000006.tmp", "v000009", "notes"):
        (tmp_path / name).mkdir()
    assert saved_versions(tmp_path) == [0, 3, 9]
    assert [p.name for p in stale_folders(tmp_path, 6)] == ["v000006.tmp", "v000009"]


def test_rebuild_chain_follows_versions_and_names_a_gap():
    steps = [{"iteration": i, "base_version": i, "weight_version": i + 1} for i in range(5)]
    assert [s["iteration"] for s in rebuild_chain(steps, 2, 5)] == [2, 3, 4]
    assert rebuild_chain(steps, 5, 5) == []
    with pytest.raises(ValueError, match="no committed train step from weight version 3"):
        rebuild_chain([s for s in steps if s["iteration"] != 3], 2, 5)


# ---- the background writer ----
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("ckpt-model"))


def test_cpu_copy_is_a_copy_and_keeps_ties():
    w = torch.ones(3)
    copied = cpu_copy({"a": w, "b": w, "c": [w[:2]], "n": 5})
    assert copied["a"] is copied["b"] and copied["a"] is not w and copied["n"] == 5
    w.add_(1)
    assert torch.equal(copied["a"], torch.ones(3)) and torch.equal(copied["c"][0], torch.ones(2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cpu_copy_of_cuda_tensors():
    w = torch.arange(6, dtype=torch.bfloat16, device="cuda")
    copied = cpu_copy({"w": w, "tied": w, "opt": {"state": {0: {"exp_avg": w.float() * 2}}}})
    assert copied["w"].device.type == "cpu" and copied["w"] is copied["tied"]
    assert copied["w"].dtype == torch.bfloat16 and torch.equal(copied["w"], w.cpu())
    w.add_(1)
    torch.cuda.synchronize()
    assert torch.equal(copied["w"], torch.arange(6, dtype=torch.bfloat16))
    assert torch.equal(copied["opt"]["state"][0]["exp_avg"], torch.arange(6).float() * 2)


def test_snapshot_holds_the_state_of_its_moment(model_dir, tmp_path):
    """The weights written are those at snapshot time, whatever training did after it."""
    tr = trainer(model_dir, 4)
    before = params(tr.model)
    snap = Snapshot.take(tr.model, {STATE_FILE: {"optimizer": tr.optimizer.state_dict()}}, {})
    tr.train(make_batch(REWARDS, seed=1))  # moves the live weights and fills the optimizer state
    assert any(not torch.equal(before[k], v) for k, v in params(tr.model).items())
    write_snapshot(snap, tmp_path / "v000000")
    written = load_file(tmp_path / "v000000" / "model.safetensors")
    assert written and all(torch.equal(written[k], before[k]) for k in written)
    assert torch.load(tmp_path / "v000000" / STATE_FILE, weights_only=False)["optimizer"]["state"] == {}
    assert not (tmp_path / "v000000.tmp").exists()


def test_background_save_equals_a_direct_save(model_dir, tmp_path):
    tr = trainer(model_dir, 4)
    tr.train(make_batch(REWARDS, seed=2))
    tr.save(str(tmp_path / "direct"))
    tr.save(str(tmp_path / "bg"), background=True)
    tr.checkpoint_writer.wait()
    names = sorted(p.name for p in (tmp_path / "direct").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "bg").iterdir())
    assert "model.safetensors" in names and STATE_FILE in names and "tokenizer.json" in names
    for name in names:
        if name != STATE_FILE:  # torch.save output embeds per-file ids; compared by value below
            assert (tmp_path / "direct" / name).read_bytes() == (tmp_path / "bg" / name).read_bytes(), name
    a, b = (torch.load(tmp_path / d / STATE_FILE, weights_only=False)["optimizer"] for d in ("direct", "bg"))
    assert a["param_groups"] == b["param_groups"]
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])


def test_a_failed_background_write_surfaces_at_the_next_save(model_dir, tmp_path):
    tr = trainer(model_dir, 4)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    tr.save(str(blocker / "v000001"), background=True)  # its parent is a file: the write fails
    with pytest.raises(CheckpointWriteError, match="a-file/v000001: write failed"):
        tr.save(str(tmp_path / "v000002"), background=True)
    assert not (tmp_path / "v000002").exists()  # the failed run stops there
    tr.save(str(tmp_path / "v000002"))  # the error was reported once; the writer works again
    assert (tmp_path / "v000002" / "model.safetensors").exists()


class _FailingModel:
    """A model whose save fails with ``error`` (what torch.save / safetensors raise)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def save_pretrained(self, folder: Path, state_dict: dict) -> None:
        folder.mkdir(parents=True)
        raise self.error


@pytest.mark.parametrize(("error", "free", "noted"), [
    # a full disk as torch.save reports it: no errno, only the free space tells
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"), 1000, True),
    (OSError(errno.ENOSPC, "No space left on device"), 10**12, True),  # said: noted whatever df says
    (RuntimeError("something else"), 10**12, False),  # room enough: not blamed on space
])
def test_a_write_failed_for_want_of_space_says_so(tmp_path, monkeypatch, error, free, noted):
    """``write failed: RuntimeError('[enforce fail at inline_container.cc:672] . unexpected
    pos ...')`` did not say the disk was full (review, 2026-11-29)."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 0, free))
    snap = Snapshot(_FailingModel(error), {"w": torch.zeros(1000)}, {}, {"config.json": b"{}"}, 1)
    writer = CheckpointWriter()
    writer.submit(tmp_path / "v000001", snap, background=True)
    with pytest.raises(CheckpointWriteError) as caught:
        writer.wait()
    message = str(caught.value)
    assert message.startswith(f"checkpoint {tmp_path / 'v000001'}: write failed")
    note = f"(no space left on the device? {free:,} bytes free at {tmp_path}, the checkpoint needs about 4,002)"
    assert (note in message) == noted, message
    assert repr(error) in message


# ---- end to end: save_interval, kill -9, resume by re-training from the lake ----
N_ITER, SAVE_INTERVAL = 5, 3  # saves v0, v3 (in the background) and v5 (the end)
LENGTH_REWARD = "tests.opshelp:length_reward"  # the weights depend on every trajectory


def _args(home: Path, run_id: str) -> list[str]:
    return ["run", "--set", f"home={home}", "--set", f"run_id={run_id}", "--set", f"num_rollout={N_ITER}",
            "--set", f"save_interval={SAVE_INTERVAL}", "--set", "keep_checkpoints=10",
            "--set", "eval.eval_interval=100", "--set", "deterministic=true",
            "--set", f"rollout.custom_rm_path={LENGTH_REWARD}", *TINY]


def _committed(home: Path, run_id: str) -> int:
    from buffer import Lake

    steps = Lake(str(home / "lake")).read("train_steps", run_id=run_id, columns=["weight_version"])
    return max(steps.column("weight_version").to_pylist())


def _tag(home: Path, run_id: str, key: str) -> str:
    from mlflow.tracking import MlflowClient

    from buffer import Lake

    client = MlflowClient(f"sqlite:///{home}/mlflow/mlflow.db")
    return client.get_run(Lake(str(home / "lake")).get_run(run_id)["mlflow_run_id"]).data.tags[key]


def _last_resume(home: Path, run_id: str) -> dict:
    return json.loads(_tag(home, run_id, "rlake.last_resume"))


def _flow_runs(api_url: str, run_id: str, flow: str) -> list:
    """The run's flow runs of ``flow``, oldest first."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[run_tag(run_id)])))
    return sorted((fr for fr in runs if flows.get(fr.flow_id) == flow), key=lambda fr: fr.created)


def _iteration_flow_runs(api_url: str, run_id: str) -> list[int]:
    """The iterations of every ``rl_iteration`` flow run of the run (generation happens only there)."""
    return sorted(fr.parameters["iteration"] for fr in _flow_runs(api_url, run_id, "rl_iteration"))


def _final_state(home: Path, run_id: str) -> tuple[dict, dict]:
    folder = home / "runs" / run_id / "checkpoints" / f"v{N_ITER:06d}"
    return load_file(folder / "model.safetensors"), torch.load(folder / STATE_FILE, weights_only=False)


def _assert_bitwise_equal(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    (wa, sa), (wb, sb) = a, b
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), "weights differ"
    oa, ob = sa["optimizer"], sb["optimizer"]
    assert oa["param_groups"] == ob["param_groups"] and oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        assert all(torch.equal(oa["state"][i][k], ob["state"][i][k]) for k in oa["state"][i]), i
    assert sa["weight_version"] == sb["weight_version"] == N_ITER


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    yield from shared_prefect_server(tmp_path_factory, "ckpt-home")


def test_save_interval_and_resume_between_saves_rebuild_from_the_lake(shared):
    root, url = shared
    # three processes at once, each with its own home (lake, MLflow: their first creation is
    # not safe to race): the reference, a kill after a commit between saves (v2 committed, v0
    # the newest checkpoint), a kill while v3 is half-written in the background (v3 committed)
    homes = {r: root / r for r in ("ref", "between", "partial")}
    faults = {"between": "during_mlflow_log:1", "partial": "during_background_write:2"}
    procs = {}
    for r, home in homes.items():
        home.mkdir()
        env = cli_env(url, **({"RLAKE_FAULT": faults[r]} if r in faults else {}))
        procs[r] = rlake(_args(home, r), env, home / "first.log", background=True)
    for r, proc in procs.items():
        assert proc.wait(timeout=900) == (0 if r == "ref" else -signal.SIGKILL), tail(homes[r] / "first.log")

    # (a) only due versions have checkpoints
    ref_ckpts = homes["ref"] / "runs/ref/checkpoints"
    assert sorted(p.name for p in ref_ckpts.iterdir()) == ["v000000", "v000003", "v000005"]

    # the crash states: committed beyond the newest complete checkpoint; a half-written v3.tmp
    assert _committed(homes["between"], "between") == 2
    assert saved_versions(homes["between"] / "runs/between/checkpoints") == [0]
    ckpts = homes["partial"] / "runs/partial/checkpoints"
    assert (_committed(homes["partial"], "partial"), saved_versions(ckpts)) == (3, [0])
    half = {p.name for p in (ckpts / "v000003.tmp").iterdir()}
    assert "model.safetensors" in half and STATE_FILE not in half

    # (b), (c): resume both; each re-trains the committed steps above v0 from the lake
    resumes = {r: rlake(["resume", r, "--home", str(homes[r])], cli_env(url), homes[r] / "resume.log",
                        background=True) for r in faults}
    for r, proc in resumes.items():
        assert proc.wait(timeout=900) == 0, tail(homes[r] / "resume.log")
    between, partial = (_last_resume(homes[r], r) for r in ("between", "partial"))
    assert between["rebuilt"] == {"from": 0, "iterations": [0, 1], "mismatched": []}
    assert partial["rebuilt"] == {"from": 0, "iterations": [0, 1, 2], "mismatched": []}
    assert "v000003.tmp" in partial["removed_stale_checkpoints"]
    assert "re-trained iterations [0, 1] on their samples in the lake (no generation)" in \
        " ".join((homes["between"] / "resume.log").read_text().split())
    # no generation for the re-trained steps: generation only runs inside rl_iteration flow runs,
    # and the resumes started none for a committed iteration (the crashed ones ran each once)
    assert _iteration_flow_runs(url, "between") == [0, 1, 2, 3, 4]
    assert _iteration_flow_runs(url, "partial") == [0, 1, 2, 3, 4]
    assert saved_versions(ckpts) == [0, SAVE_INTERVAL, N_ITER] and not (ckpts / "v000003.tmp").exists()

    reference = _final_state(homes["ref"], "ref")
    _assert_bitwise_equal(_final_state(homes["between"], "between"), reference)
    _assert_bitwise_equal(_final_state(homes["partial"], "partial"), reference)

    # versions with no checkpoint say so in the registry (their weights live in the lake's log)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{homes['between']}/mlflow/mlflow.db")
    tags = {int(v.tags["weight_version"]): v.tags["checkpoint"]
            for v in client.search_model_versions("name='rlake-between'")}
    assert sorted(tags) == list(range(N_ITER + 1))
    assert [v for v, path in sorted(tags.items()) if path] == [0, SAVE_INTERVAL, N_ITER]

    # a replay starting at a version that was never saved (v4) rebuilds it from the source's v3
    # and the source's recorded slice of iteration 3; its one step then reproduces the source's v5
    log = homes["ref"] / "replay.log"
    proc = rlake(["replay", "ref", "--home", str(homes["ref"]), "--iterations", "4:5", "--run-id", "rep"],
                 cli_env(url), log)
    assert proc.returncode == 0, tail(log)
    assert "re-trained from the lake" in _tag(homes["ref"], "rep", "rlake.replay_start")
    replayed = load_file(homes["ref"] / "runs/rep/checkpoints/v000001/model.safetensors")
    assert all(torch.equal(replayed[k], reference[0][k]) for k in reference[0])


def _reference_home(root: Path, url: str) -> Path:
    """The uninterrupted ``N_ITER``-iteration run's home (the test above runs it; run here when
    that test was not)."""
    home = root / "ref"
    if not (home / "runs/ref/checkpoints" / f"v{N_ITER:06d}").exists():
        home.mkdir(exist_ok=True)
        proc = rlake(_args(home, "ref"), cli_env(url), home / "first.log")
        assert proc.returncode == 0, tail(home / "first.log")
    return home


def test_a_finished_run_resumed_with_a_larger_num_rollout_trains_on_as_one_run(shared):
    """``rlake resume RUN --num-rollout N`` (slime's ``--num-rollout`` on a relaunch): a finished
    3-iteration run extended to 5 ends bitwise equal to the 5-iteration run, each iteration
    generated once; the new length is recorded with the run (its config, its notes, an MLflow
    tag: params keep their first value); below the committed iterations it is refused and
    nothing changes."""
    from buffer import Lake

    root, url = shared
    reference = _final_state(_reference_home(root, url), "ref")
    home = root / "short"
    home.mkdir()
    args = [a.replace(f"num_rollout={N_ITER}", "num_rollout=3") for a in _args(home, "short")]
    assert args != _args(home, "short")
    proc = rlake(args, cli_env(url), home / "first.log")
    assert proc.returncode == 0, tail(home / "first.log")

    def recorded() -> tuple[int, str, dict]:
        row = Lake(str(home / "lake")).get_run("short")
        return json.loads(row["config"])["num_rollout"], row["status"], json.loads(row["notes"])

    proc = rlake(["resume", "short", "--home", str(home), "--num-rollout", "2"], cli_env(url),
                 home / "refused.log")
    said = " ".join((home / "refused.log").read_text().split())
    assert proc.returncode == 1 and ("error: --num-rollout 2: run 'short' has committed 3 "
                                     "iterations (0..2); give 3 or more (it has num_rollout=3)") in said, said
    assert recorded()[:2] == (3, "completed") and "num_rollout_changes" not in recorded()[2]

    proc = rlake(["resume", "short", "--home", str(home), "--num-rollout", str(N_ITER)],
                 cli_env(url), home / "extend.log")
    assert proc.returncode == 0, tail(home / "extend.log")
    num_rollout, status, notes = recorded()
    assert (num_rollout, status) == (N_ITER, "completed")
    assert [(c["from"], c["to"]) for c in notes["num_rollout_changes"]] == [(3, N_ITER)]
    assert _tag(home, "short", "rlake.num_rollout") == str(N_ITER)
    assert _iteration_flow_runs(url, "short") == list(range(N_ITER))
    # the resume's rl_run flow run got the run's config, not the defaults with a home (seed 0,
    # 32 prompts and a relative home showed in Prefect: review, 2026-11-29)
    first, resumed = (fr.parameters["config"] for fr in _flow_runs(url, "short", "rl_run"))
    assert resumed == {**first, "num_rollout": N_ITER} and first["num_rollout"] == 3
    _assert_bitwise_equal(_final_state(home, "short"), reference)
    start = load_file(home / "runs/short/checkpoints/v000000/model.safetensors")
    assert any(not torch.equal(start[k], v) for k, v in reference[0].items())  # it learned
