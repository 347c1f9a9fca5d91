"""Small, fast checks of the resume pieces: fault spec parsing and firing, the commit point and
checkpoint pruning, orphan-server detection, the run lock, and the CLI input parsers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from buffer import Lake
from flows.deployments import save_spec
from infra.config import config_from_dict
from infra.faults import parse_faults
from infra.recovery import SERVER_SIGNATURE, _cmdline, claim_run, orphan_servers, pid_alive, stop_processes
from infra.runtime import Runtime, iteration_seed, resume_point
from infra.startup import parse_iterations
from tests.opshelp import ROOT


def test_parse_faults():
    assert parse_faults("after_lake_append:3, during_train:0") == {"after_lake_append": 3, "during_train": 0}
    assert parse_faults("") == {}
    with pytest.raises(ValueError, match="unknown fault point 'nope'"):
        parse_faults("nope:1")
    with pytest.raises(ValueError, match="point:iteration"):
        parse_faults("during_train")


@pytest.mark.parametrize(("iteration", "killed"), [(2, True), (1, False)])
def test_fault_point_kills_only_at_its_iteration(iteration, killed):
    code = ("from infra.faults import set_iteration, fault_point\n"
            f"set_iteration({iteration})\nfault_point('during_train')\nprint('alive')")
    env = {**os.environ, "RLAKE_FAULT": "during_train:2"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert (proc.returncode == -9) == killed and ("alive" in proc.stdout) != killed


def test_iteration_seed_distinct():
    seeds = {iteration_seed(s, i) for s in range(5) for i in range(200)}
    assert len(seeds) == 1000


def _runtime(tmp_path: Path, keep: int) -> Runtime:
    cfg = config_from_dict({"home": str(tmp_path), "keep_checkpoints": keep})
    return Runtime(cfg=cfg, run_id="r", home=tmp_path, lake=Lake(str(tmp_path / "lake")), tracker=None,
                   tokenizer=None, dataset=None, held_out=[], reward_fn=None)


def _commit(rt: Runtime, version: int) -> None:
    rt.lake.append_train_step({"run_id": "r", "step": version - 1, "iteration": version - 1,
                               "base_version": version - 1, "weight_version": version,
                               "sample_uids": []})


def test_resume_point_uses_newest_checkpoint_at_or_below_committed(tmp_path):
    rt = _runtime(tmp_path, keep=3)
    base = tmp_path / "base"
    assert resume_point(rt, base) == (0, 0, base)  # nothing yet: SFT runs again
    for v in (0, 1, 3):
        rt.checkpoint_dir(v).mkdir(parents=True)
    assert resume_point(rt, base) == (0, 0, rt.checkpoint_dir(0))  # SFT done, no step
    for v in (1, 2):
        _commit(rt, v)
    # v3 exists (saved) but has no train_steps row: a crash before the commit point; v2 was never
    # saved (between save_interval saves): load v1, the committed step 1 -> 2 is re-trained
    assert resume_point(rt, base) == (2, 1, rt.checkpoint_dir(1))
    assert rt.latest_checkpoint() == 1
    (rt.checkpoint_root / "v000002.tmp").mkdir()  # a write that never finished its rename
    assert resume_point(rt, base) == (2, 1, rt.checkpoint_dir(1))
    import shutil

    for v in (0, 1):
        shutil.rmtree(rt.checkpoint_dir(v))
    with pytest.raises(FileNotFoundError, match="no checkpoint at or below the committed weight version 2"):
        resume_point(rt, base)


def test_prune_never_deletes_committed_or_newer(tmp_path):
    rt = _runtime(tmp_path, keep=1)
    for v in range(6):
        rt.checkpoint_dir(v).mkdir(parents=True)
    for v in (1, 2, 3):
        _commit(rt, v)
    rt.prune_checkpoints(keep_version=5)  # v4, v5 saved but not committed
    assert sorted(p.name for p in rt.checkpoint_root.iterdir()) == ["v000003", "v000004", "v000005"]


def test_prune_keeps_what_a_resume_needs(tmp_path):
    """Committed 7, saved v0, v5, v8 (uncommitted) with keep_checkpoints=1: the newest saved is v8,
    but a resume needs v5 (the newest at or below the commit); v0 only goes without a reference."""
    rt = _runtime(tmp_path, keep=1)
    for v in (0, 5, 8):
        rt.checkpoint_dir(v).mkdir(parents=True)
    for v in range(1, 8):
        _commit(rt, v)
    rt.prune_checkpoints()
    assert sorted(p.name for p in rt.checkpoint_root.iterdir()) == ["v000005", "v000008"]


def _spawn_orphan(prefect_home: Path) -> int:
    """A process that looks like an embedded Prefect server and whose parent has exited.
    Returns once it runs Python (it writes a file then): before that its command line is the
    shell's, not a server's."""
    pid_file, ready = prefect_home / "orphan.pid", prefect_home / "orphan.ready"
    code = f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(120)"
    script = f'{sys.executable} -c "{code}" {SERVER_SIGNATURE} >/dev/null 2>&1 & echo $! > {pid_file}'
    subprocess.run(["sh", "-c", script], env={**os.environ, "PREFECT_HOME": str(prefect_home)}, check=True)
    guard = time.monotonic() + 300  # a hang guard, not a speed expectation
    while not ready.exists():
        assert time.monotonic() < guard, "the orphan process never started Python"
        time.sleep(0.05)
    return int(pid_file.read_text())


def test_orphan_server_found_and_stopped(tmp_path):
    home = tmp_path / "prefect"
    home.mkdir()
    orphan = _spawn_orphan(home)
    own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", SERVER_SIGNATURE],
                           env={**os.environ, "PREFECT_HOME": str(home)})
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", SERVER_SIGNATURE],
                             env={**os.environ, "PREFECT_HOME": str(tmp_path / "elsewhere")})
    try:
        found = orphan_servers(home)
        # the orphan: yes; a live child of a Python process (ours): no; another PREFECT_HOME: no
        assert found == [orphan]
        stop_processes(found)
        assert not pid_alive(orphan)
        assert pid_alive(own.pid) and pid_alive(other.pid)
    finally:
        for proc in (own, other):
            proc.kill()
            proc.wait()
        stop_processes([orphan])


def test_claim_run_refuses_a_live_owner(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # between fork and exec its /proc cmdline can be empty (CI, 2026-11-29): wait for exec
        deadline = time.monotonic() + 30
        while "time.sleep" not in _cmdline(other.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        (tmp_path / "owner.pid").write_text(str(other.pid))
        with pytest.raises(ValueError, match=f"in use by process {other.pid}"):
            claim_run(tmp_path)
    finally:
        other.kill()
        other.wait()
    claim_run(tmp_path)  # the owner is gone: taken over
    assert (tmp_path / "owner.pid").read_text() == str(os.getpid())


def test_cli_input_parsers(tmp_path):
    assert parse_iterations("2:5") == (2, 5)
    assert parse_iterations("3") == (3, 4)
    assert parse_iterations("4:") == (4, None)
    assert parse_iterations(None) == (0, None)
    for bad in ("5:2", "a:b", "-1:3"):
        with pytest.raises(ValueError, match="--iterations"):
            parse_iterations(bad)
    with pytest.raises(ValueError, match="exactly one of --cron"):
        save_spec(tmp_path, "n", {}, "r", None, None)
    with pytest.raises(ValueError, match="not a valid cron"):
        save_spec(tmp_path, "n", {}, "r", "every day", None)
    with pytest.raises(ValueError, match="--name"):
        save_spec(tmp_path, "bad name!", {}, "r", None, 5)
    path = save_spec(tmp_path, "nightly", {"seed": 1}, "r", "0 3 * * *", None)
    assert path.name == "nightly.json"


def test_server_watch_reports_a_lost_server_once_and_not_after_stop(tmp_path, monkeypatch):
    from infra.prefect_server import ServerWatch, run_server_liveness

    state, lost = {"alive": True}, []
    watch = ServerWatch(lambda: state["alive"], lambda: lost.append(1), interval_s=0.01)
    time.sleep(0.1)
    assert lost == []
    state["alive"] = False
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    watch.stop()
    assert lost == [1]
    quiet: list[int] = []
    ServerWatch(lambda: False, lambda: quiet.append(1), interval_s=0.5).stop()
    assert quiet == []  # a run that ended stops its watch before its server
    # a server from outside (PREFECT_API_URL, no server.json of this home) is not watched
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    assert run_server_liveness(None, tmp_path) is None
