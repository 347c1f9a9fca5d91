"""Small, fast checks of the resume pieces: fault spec parsing and firing, the commit point and
checkpoint pruning, orphan-server detection, the run lock, and the CLI input parsers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from buffer import Lake
from flows.deployments import save_spec
from infra.config import config_from_dict
from infra.faults import parse_faults
from infra.recovery import (
    SERVER_SIGNATURE,
    _cmdline,
    claim_run,
    orphan_servers,
    pid_alive,
    release_run,
    run_owner,
    stop_processes,
)
from infra.runtime import Runtime, iteration_seed
from infra.runtime import resume_point as _resume_point
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
    """Folder selection only (empty folders pass): the files are checked in
    test_resume_point_sets_aside_a_damaged_checkpoint."""
    rt = _runtime(tmp_path, keep=3)
    base = tmp_path / "base"
    resume_point = partial(_resume_point, problem=lambda folder, version: None)
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


def test_resume_point_sets_aside_a_damaged_checkpoint(tmp_path):
    """A damaged newest checkpoint stopped the resume with an error naming no file (truncated
    weights, an empty folder, a truncated trainer state), and one without its optimizer state
    resumed with a fresh optimizer, silently ending elsewhere (review, 2026-11-29): each is set
    aside with a warning naming the file, and the next older checkpoint is used."""
    import shutil

    from tests.trainer_fixtures import build_model, trainer
    from trainers.torch_trainer import STATE_FILE

    rt = _runtime(tmp_path, keep=3)
    tr = trainer(build_model(tmp_path), 4)
    for v in (0, 1):
        tr.save(str(rt.checkpoint_dir(v)))
    for v in (1, 2):
        _commit(rt, v)
    good = tmp_path / "good"
    shutil.copytree(rt.checkpoint_dir(1), good)
    warnings = []
    rt.reporter = lambda event, payload: warnings.append(payload["message"])

    def damage(how) -> str:
        shutil.rmtree(rt.checkpoint_dir(1), ignore_errors=True)
        shutil.copytree(good, rt.checkpoint_dir(1))
        how(rt.checkpoint_dir(1))
        warnings.clear()
        assert _resume_point(rt, tmp_path / "base") == (2, 0, rt.checkpoint_dir(0))
        assert not rt.checkpoint_dir(1).exists() and len(warnings) == 1
        return warnings[0]

    def truncate(path: Path) -> None:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    assert "model.safetensors" in damage(lambda d: truncate(d / "model.safetensors"))
    assert f"{STATE_FILE} is missing" in damage(lambda d: (d / STATE_FILE).unlink())
    assert f"{STATE_FILE} is not readable" in damage(lambda d: truncate(d / STATE_FILE))
    message = damage(lambda d: [p.unlink() for p in d.iterdir()])
    assert "no config.json" in message and "set aside as v000001.unusable.4" in message
    assert sorted(p.name for p in rt.checkpoint_root.iterdir()) == [
        "v000000", "v000001.unusable", "v000001.unusable.2", "v000001.unusable.3", "v000001.unusable.4"]
    # a warning found before anyone listens is held until a reporter is set
    rt.reporter = None
    shutil.copytree(good, rt.checkpoint_dir(1))
    (rt.checkpoint_dir(1) / STATE_FILE).unlink()
    _resume_point(rt, tmp_path / "base")
    rt.reporter = lambda event, payload: warnings.append((event, payload["message"]))
    assert warnings[-1][0] == "warning" and "is missing" in warnings[-1][1]


def test_a_resume_runs_at_the_home_and_lake_it_was_found_in(tmp_path):
    """The recorded config's home is the path as given then (``./rlake-home`` by default): a
    resume of a moved home, or from another folder, loaded the old base model and failed in
    async mode's rollout process (review, 2026-11-29)."""
    import json

    from infra.runtime import recorded_config

    row = {"config": json.dumps(config_from_dict({"home": "./rlake-home", "seed": 7}).model_dump())}
    now = config_from_dict({"home": str(tmp_path)})
    cfg = recorded_config(row, now, tmp_path)
    assert (cfg.home, cfg.resolved_lake_uri, cfg.seed) == (str(tmp_path), str(tmp_path / "lake"), 7)
    elsewhere = config_from_dict({"home": str(tmp_path), "lake_uri": str(tmp_path / "shared-lake")})
    assert recorded_config(row, elsewhere, tmp_path).resolved_lake_uri == str(tmp_path / "shared-lake")


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


# a process that claims the run folder argv[1] (at wall-clock time argv[2], when given, so that
# several claim at once), says "claimed <pid>" or "refused", and lives until its stdin closes;
# with argv[3] it first starts a child that outlives it (a server, a worker) and says its PID
CLAIMER = """
import subprocess, sys, time
from pathlib import Path
from infra.recovery import claim_run
if len(sys.argv) > 3:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print("child", child.pid, flush=True)
if len(sys.argv) > 2:
    time.sleep(max(0.0, float(sys.argv[2]) - time.time() - 0.01))
    while time.time() < float(sys.argv[2]):  # the last moment spinning: they start together
        pass
try:
    claim_run(Path(sys.argv[1]))
    print("claimed", flush=True)
except ValueError as e:
    print("refused", e, flush=True)
sys.stdin.read()
"""


def _claimer(run_dir: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLAIMER, str(run_dir), *args], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _end(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def test_claim_run_refuses_a_live_owner(tmp_path):
    other = _claimer(tmp_path)
    try:
        assert other.stdout.readline().strip() == "claimed"
        assert run_owner(tmp_path) == other.pid
        with pytest.raises(ValueError, match=f"in use by process {other.pid}"):
            claim_run(tmp_path)
    finally:
        _end(other)
    assert run_owner(tmp_path) is None
    claim_run(tmp_path)  # the owner is gone: taken over
    try:
        assert (tmp_path / "owner.pid").read_text() == str(os.getpid())
    finally:
        release_run(tmp_path)
    assert not (tmp_path / "owner.pid").exists()


def test_claim_run_is_atomic(tmp_path):
    """Processes claiming one run folder at the same moment: exactly one gets it (the check then
    write of owner.pid let two in, or crashed one on their shared temp file, 2026-11-29)."""
    for trial in range(12):  # it let two in about once in eight trials
        run_dir = tmp_path / str(trial)
        at = time.time() + 0.4  # all started and waiting by then
        procs = [_claimer(run_dir, str(at)) for _ in range(3)]
        try:
            said = sorted(p.stdout.readline().split()[0] if p.stdout else "" for p in procs)
        finally:
            for proc in procs:
                _end(proc)
        assert said == ["claimed", "refused", "refused"], said


def test_claim_run_takes_over_a_dead_owners_reused_pid(tmp_path):
    """owner.pid of a dead run naming a live Python process that took its PID since, and does
    not hold the lock: not an owner (it was refused as "in use")."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30  # between fork and exec its cmdline is not python's yet
        while "time.sleep" not in _cmdline(other.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        (tmp_path / "owner.pid").write_text(str(other.pid))
        (tmp_path / "owner.lock").touch()
        assert run_owner(tmp_path) is None
        claim_run(tmp_path)
        release_run(tmp_path)
    finally:
        _end(other)


def test_claim_run_lock_dies_with_its_process_not_its_children(tmp_path):
    """A child of the owner (Prefect's server, a reward worker) that outlives it does not keep
    the run locked: the lock's descriptor is not inherited."""
    owner = _claimer(tmp_path, "0", "with a child")
    child = int(owner.stdout.readline().split()[1])
    try:
        assert owner.stdout.readline().strip() == "claimed"
        _end(owner)  # kill -9
        assert pid_alive(child)
        assert run_owner(tmp_path) is None
        claim_run(tmp_path)
        release_run(tmp_path)
    finally:
        stop_processes([child], grace_s=0)


def test_claim_run_nests_in_one_process(tmp_path):
    """The startup and then the flow claim the run in one process; the run stays owned until the
    outer release."""
    claim_run(tmp_path)
    claim_run(tmp_path)
    release_run(tmp_path)
    other = _claimer(tmp_path)
    try:
        assert other.stdout.readline().startswith(f"refused run folder {tmp_path} is in use by "
                                                  f"process {os.getpid()}")
    finally:
        _end(other)
    assert (tmp_path / "owner.pid").read_text() == str(os.getpid())
    release_run(tmp_path)
    release_run(tmp_path)  # one too many: nothing to undo
    assert not (tmp_path / "owner.pid").exists()
    other = _claimer(tmp_path)
    try:
        assert other.stdout.readline().strip() == "claimed"
    finally:
        _end(other)


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


def test_a_stale_checkpoint_that_cannot_be_deleted_stops_the_resume(tmp_path, monkeypatch):
    """A checkpoint above the commit that could not be deleted was reported as removed
    (``rmtree(ignore_errors=True)``) and stayed, for a later resume to trust (review,
    2026-11-29); an unfinished ``.tmp`` write is only warned about (never trusted)."""
    import shutil

    from flows import durability

    rt = _runtime(tmp_path, keep=3)
    _commit(rt, 1)
    for name in ("v000001", "v000002", "v000003.tmp"):
        (rt.checkpoint_root / name).mkdir(parents=True)
    real = shutil.rmtree

    def stuck(path, *args, **kwargs):
        if Path(path).name in ("v000002", "v000003.tmp"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(durability.shutil, "rmtree", stuck)
    with pytest.raises(RuntimeError, match=r"could not delete .*v000002, a checkpoint above the committed"):
        durability.remove_stale_checkpoints(rt)
    real(rt.checkpoint_root / "v000002")  # the user deletes it: the resume goes on
    warnings = []
    rt.reporter = lambda event, payload: warnings.append(payload["message"])
    assert durability.remove_stale_checkpoints(rt) == []
    assert "v000003.tmp" in warnings[0] and (rt.checkpoint_root / "v000001").exists()
