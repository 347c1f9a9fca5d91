"""Every command through the entry point users run: ``python -m infra.cli`` and the installed
``rlake`` console script (both call ``infra.cli:main``), exit codes included.

``typer``'s ``app(standalone_mode=False)`` hands ``typer.Exit`` codes back as a return value; an
entry point that ignores it exits 0 after printing an error (issue 17.1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from buffer import Lake
from buffer.synth import synthetic_rows
from infra.ports import free_port
from tests.conftest import REPO, run_cli

SCRIPT = Path(sys.executable).parent / "rlake"  # the console script installed in this venv


def rlake(*args: str, entry: str = "module", timeout: float = 300) -> subprocess.CompletedProcess:
    if entry == "module":
        return run_cli(list(args), check=False, timeout=timeout)
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    return subprocess.run([str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A state folder whose lake holds one run with trajectories, train steps and evals."""
    from infra.config import RunConfig

    home = tmp_path_factory.mktemp("entry-home")
    lake = Lake(str(home / "lake"))
    lake.upsert_run({"run_id": "r", "status": "completed", "config": RunConfig().model_dump_json()})
    lake.append_trajectories(synthetic_rows("r", 0, 8, weight_version=0))
    lake.append_trajectories(synthetic_rows("r", 1, 8, weight_version=1))
    for i in range(2):
        lake.append_train_step({"run_id": "r", "step": i, "iteration": i, "base_version": i,
                                "weight_version": i + 1, "lake_version": i, "n_samples": 8,
                                "sample_uids": [f"r/{i}/{k}" for k in range(8)], "ppo_kl": 0.01,
                                "entropy": 2.0, "timings": json.dumps({"train": 1.0})})
    return home


@pytest.mark.parametrize("entry", ["module", "script"])
def test_failure_is_one_line_and_non_zero_traceback_only_with_debug(home, entry):
    res = rlake("status", "nope", "--home", str(home), entry=entry)
    assert res.returncode == 1, res.stdout
    assert res.stderr.strip().splitlines() == [
        f"error: no run 'nope' in the lake at {home / 'lake'}  (rlake --debug status ... for the "
        "traceback)"]  # --debug after the command is a usage error (review, 2026-11-29)
    res = rlake("--debug", "status", "nope", "--home", str(home), entry=entry)
    assert res.returncode == 1
    assert "Traceback" in res.stderr and "ValueError: no run 'nope'" in res.stderr
    res = rlake("sql", "DELETE FROM trajectories", "--lake", str(home / "lake"), entry=entry)
    assert res.returncode == 2 and "refused DELETE statement" in res.stderr
    res = rlake("status", "r", "--home", str(home), entry=entry)
    assert res.returncode == 0 and "status: completed" in res.stdout


def test_usage_errors_exit_2():
    for args, message in ((["no-such-command"], "No such command"),
                          (["serve", "--port", "0"], "--port"),
                          (["serve", "--port", "70000"], "--port"),
                          (["serve", "--limit", "0"], "--limit"),
                          (["serve", "--maintenance-interval", "-1"], "--maintenance-interval"),
                          (["ui", "grafana"], "choose one of prefect, mlflow"),
                          (["ui", "mlflow", "--port", "0"], "--port"),
                          (["lineage", "r", "--version", "1", "--samples", "-1"], "--samples")):
        res = rlake(*args)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert message in res.stderr, (args, res.stderr)


def test_report_and_lineage(home, tmp_path):
    out = tmp_path / "rep" / "report.html"
    res = rlake("report", "r", "--home", str(home), "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert out.exists() and (tmp_path / "rep" / "report-kl_entropy.png").exists()
    res = rlake("report", "nope", "--home", str(home), "--out", str(out))
    assert res.returncode == 1 and "no run 'nope'" in res.stderr
    res = rlake("lineage", "r", "--version", "2", "--home", str(home), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["version"] == 2
    res = rlake("lineage", "r", "--version", "9", "--home", str(home))
    assert res.returncode == 1 and "error:" in res.stderr and "Traceback" not in res.stderr


def test_lineage_of_version_0_needs_the_run(home, tmp_path):
    """Version 0's answer ("the starting policy", exit 0) came before the check that the run
    exists: any run id or home was accepted (review, 2026-11-29)."""
    from infra.lineage import version_lineage

    for lake, run_id in ((Lake(str(tmp_path / "no-such-home" / "lake")), "r"),
                         (Lake(str(home / "lake")), "nope")):
        with pytest.raises(ValueError, match=f"no run '{run_id}' in the lake"):
            version_lineage(lake, run_id, 0)
    assert "starting policy" in version_lineage(Lake(str(home / "lake")), "r", 0)["note"]


def test_report_out_inside_the_lake_or_a_folder_is_refused_before_drawing(home, tmp_path):
    """``report --out`` in a _delta_log overwrote a Delta commit with HTML (``sql --out`` refuses
    it); ``--out FOLDER`` wrote five PNGs beside the folder, then failed (review, 2026-11-29)."""
    import shutil

    copy = tmp_path / "home"
    shutil.copytree(home, copy)  # the module's home stays intact if the refusal is broken
    commit = copy / "lake" / "runs" / "_delta_log" / "00000000000000000099.json"
    res = rlake("report", "r", "--home", str(copy), "--out", str(commit))
    assert res.returncode == 2 and "is inside the lake" in res.stderr, (res.stdout, res.stderr)
    assert not commit.exists() and not list(commit.parent.glob("*.png"))
    folder = tmp_path / "out"
    folder.mkdir()
    res = rlake("report", "r", "--home", str(copy), "--out", str(folder))
    assert res.returncode == 2 and f"--out {folder}: is a folder, not a file" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "out"] and not any(folder.iterdir())


def test_replay_config_errors_before_anything_starts(home, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    cases = ((["--config", str(tmp_path / "missing.yaml")], "config file not found"),
             (["--config", str(bad)], "the top level must be a mapping"))
    for extra, message in cases:
        res = rlake("replay", "r", "--home", str(home), *extra)
        assert res.returncode == 1, res.stdout
        assert message in res.stderr and "Traceback" not in res.stderr
    res = rlake("replay", "nope", "--home", str(home))
    assert res.returncode == 1 and "no run 'nope'" in res.stderr
    # a replay's own arguments too: no run of it is recorded (a bad --iterations left a failed one)
    cases = ((["--iterations", "5:2"], "--iterations '5:2': need 0 <= A < B"),
             (["--iterations", "x"], "--iterations 'x' must look like A:B"),
             (["--iterations", "5:9"], "run 'r' has no train trajectories in iterations 5:9 "
                                      "(it has iterations 0..1)"),
             (["--rescore", "nosuch"], "--rescore 'nosuch': unknown rm_type 'nosuch'"),
             (["--rescore", "nosuch_module:fn"], "--rescore 'nosuch_module:fn' cannot be loaded"),
             (["--rescore", "tests.opshelp:tail"], "--rescore 'tests.opshelp:tail' must accept 2"))
    runs = Lake(str(home / "lake")).read("runs").num_rows
    for extra, message in cases:
        res = rlake("replay", "r", "--home", str(home), "--run-id", "never", *extra)
        assert res.returncode == 1, res.stdout
        assert message in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert Lake(str(home / "lake")).read("runs").num_rows == runs
    assert not (home / "runs" / "never").exists()


def test_deploy_cron_validation(tmp_path):
    args = ["deploy", "configs/quickstart.yaml", "--name", "nightly", "--set", f"home={tmp_path}"]
    res = rlake(*args, "--cron", "every night")
    assert res.returncode == 1 and "--cron 'every night' is not a valid cron expression" in res.stderr
    res = rlake(*args, "--cron", "0 3 * * *", "--interval", "60")
    assert res.returncode == 1 and "exactly one of --cron" in res.stderr
    assert not (tmp_path / "deployments").exists() or not any((tmp_path / "deployments").iterdir())
    res = rlake(*args, "--cron", "0 3 * * *")
    assert res.returncode == 0 and "cron '0 3 * * *'" in res.stdout


def test_deploy_refuses_a_run_the_lake_holds_with_another_config(tmp_path):
    """A deployment continues its run with the config the run was started with (a resume reads
    it from the lake): ``--run-id`` naming a run started with another config is refused when
    deployed, naming the keys, and so is a tick of a deployment recorded before (the flow);
    the run's own config deploys."""
    from flows.deployments import scheduled_run
    from infra.config import ConfigError, load_config

    home = tmp_path / "home"
    started = load_config("configs/quickstart.yaml", [f"home={home}", "trainer.lr=0.001"])
    Lake(str(home / "lake")).upsert_run({"run_id": "elsewhere", "status": "running",
                                         "config": started.model_dump_json()})
    args = ["deploy", "configs/quickstart.yaml", "--name", "nightly", "--cron", "0 3 * * *",
            "--run-id", "elsewhere", "--set", f"home={home}"]
    res = rlake(*args, "--set", "num_rollout=7")
    assert res.returncode == 1, res.stdout
    assert "run 'elsewhere' is in the lake with another config" in res.stderr
    assert "num_rollout: 100 -> 7; trainer.lr: 0.001 -> 0.0003" in res.stderr, res.stderr
    assert not (home / "deployments").exists()
    with pytest.raises(ConfigError, match="trainer.lr: 0.001 -> 0.0003"):
        scheduled_run.fn(load_config("configs/quickstart.yaml", [f"home={home}"]).model_dump(),
                         "elsewhere")
    res = rlake(*args, "--set", "trainer.lr=0.001")
    assert res.returncode == 0 and (home / "deployments" / "nightly.json").exists(), res.stderr


# ---- rlake ui -------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def _listening(port: int) -> set[str]:
    """Local addresses (hex, /proc/net/tcp form) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if int(hex_port, 16) == port and state == "0A":
                found.add(address)
    return found


def _wait_for_line(proc: subprocess.Popen, log: Path, needle: str, timeout_s: float) -> str:
    """Hang guard: the first line of ``log`` containing ``needle``, waiting at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if needle in line:
                return line
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"no {needle!r} from rlake ui in {timeout_s}s:\n{log.read_text()[-3000:]}")


@pytest.mark.parametrize("which, health, analytics_off", [
    ("mlflow", "/health", {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}),
    ("prefect", "/api/health", {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true"}),
])
def test_ui_serves_on_loopback_offline_and_stops_on_ctrl_c(tmp_path, which, health, analytics_off):
    from infra.tracking import Tracker

    home = tmp_path / "home"
    Tracker(home)  # the MLflow store and its "rlake" experiment, as a run leaves them
    (home / "prefect").mkdir()
    port = free_port()
    log = tmp_path / "ui.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "infra.cli", "ui", which, "--home", str(home),
                                 "--port", str(port)], cwd=REPO, env=env, stdout=out, stderr=out)
    try:
        line = _wait_for_line(proc, log, f"{which} UI: http://127.0.0.1:{port}", 300)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{health}", timeout=10) as resp:
            assert resp.status == 200
        assert _listening(port) == {"0100007F"}, "the UI must listen on 127.0.0.1 only"
        servers = [p for p in _children(proc.pid) if str(port) in Path(f"/proc/{p}/cmdline").read_text()]
        assert servers, "no UI server process under rlake ui"
        for key, value in analytics_off.items():
            assert _environ(servers[0]).get(key) == value, key
        if which == "mlflow":
            assert "/#/experiments/" in line and "/runs?workflowType=machine_learning" in line
            exp_id = line.split("/#/experiments/")[1].split("/")[0]
            url = f"http://127.0.0.1:{port}/ajax-api/2.0/mlflow/experiments/get?experiment_id={exp_id}"
            with urllib.request.urlopen(url, timeout=10) as resp:
                tags = {t["key"]: t["value"] for t in json.load(resp)["experiment"]["tags"]}
            assert tags["mlflow.experimentKind"] == "custom_model_development"
        everything = [proc.pid, *_children(proc.pid)]
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(120) == 130, log.read_text()[-2000:]
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in everything) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [p for p in everything if _alive(p)], "UI processes left behind"
        assert "Traceback" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _children(proc.pid):
            os.kill(pid, signal.SIGKILL)


def test_ui_needs_the_state_of_a_run(tmp_path):
    res = rlake("ui", "mlflow", "--home", str(tmp_path / "nothing"))
    assert res.returncode == 1 and "no mlflow state under --home" in res.stderr


# ---- a run in a terminal ----------------------------------------------------------------------

ANSI = __import__("re").compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _run_in_pty(args: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """Run ``args`` with a pseudo-terminal as stdin/stdout/stderr (what a user's terminal gives
    rich and Prefect); (exit code, everything written, ANSI codes and carriage returns removed)."""
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:  # child
        os.chdir(REPO)
        os.execve(args[0], args, env)
    chunks, deadline = [], time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
        else:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"run did not finish in {timeout_s}s: "
                                 f"{b''.join(chunks).decode(errors='replace')[-3000:]}")
    finally:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    text = ANSI.sub("", b"".join(chunks).decode(errors="replace")).replace("\r", "")
    return os.waitstatus_to_exitcode(status), text


def test_tty_run_output_is_clean_and_its_commands_run_without_the_venv(tmp_path):
    import shlex

    from infra.progress import rlake_invocation
    from tests.opshelp import TINY

    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update({"PYTHONPATH": str(REPO), "COLUMNS": "80", "TERM": "xterm"})
    code, text = _run_in_pty([sys.executable, "-m", "infra.cli", "run", "--set", f"home={home}",
                              "--set", "run_id=tty", "--set", "num_rollout=1", *TINY], env, 1200)
    assert code == 0, text[-3000:]
    for leak in ("Creating initial MLflow database tables", "Updating database tables",
                 "Traceback", "CancelledError"):
        assert leak not in text, f"{leak!r} in the terminal output:\n{text[-3000:]}"
    lines = text.splitlines()
    rlake_cmd = rlake_invocation()
    status_cmd = f"  {rlake_cmd} status tty --home {home.resolve()}"
    assert status_cmd in lines, "\n".join(lines[-15:])  # whole, on one line, at 80 columns
    sql_cmd = next(line for line in lines if line.startswith(f"  {rlake_cmd} sql "))
    for ui in ("mlflow", "prefect"):
        assert f"  {rlake_cmd} ui {ui} --home {home.resolve()}" in lines
    assert not any(line.lstrip().startswith(("rlake ", "mlflow ", "PREFECT_HOME=")) for line in lines)
    bare = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": os.environ.get("HOME", "/tmp")}
    for command, expect in ((status_cmd, "status: completed"), (sql_cmd, "(1 row)")):
        res = subprocess.run(shlex.split(command), env=bare, capture_output=True, text=True,
                             timeout=300, cwd=tmp_path)
        assert res.returncode == 0 and expect in res.stdout, (command, res.stdout, res.stderr)


def test_status_shows_whole_run_ids_and_a_quoted_resume_command(tmp_path):
    """In 80 columns (or a pipe) the run list cut ``20261129-101716-b51b89`` to
    ``20261129-1017…``; an interrupted run's resume command was not shell-quoted (review,
    2026-11-29)."""
    import io
    import shlex

    from rich.console import Console

    from infra.status import show_status

    home = tmp_path / "home with space"
    lake = Lake(str(home / "lake"))
    run_id = "20261129-101716-b51b89"
    lake.upsert_run({"run_id": run_id, "status": "running"})
    (home / "runs" / run_id).mkdir(parents=True)  # no owner.pid: shown as interrupted
    out = io.StringIO()
    console = Console(file=out, width=80)
    show_status(console, lake.uri, None, str(home))
    assert run_id in out.getvalue(), out.getvalue()
    show_status(console, lake.uri, run_id, str(home))
    hint = next(x for x in out.getvalue().splitlines() if "no live process owns it" in x)
    assert shlex.split(hint.split("(killed?): ")[1]) == ["rlake", "resume", run_id, "--home", str(home)]


def test_ctrl_c_while_the_cli_imports_is_one_line_and_130():
    """A Ctrl-C in a command's first second (``infra.cli`` importing typer, the lake...) printed a
    traceback: main's handler was not set up yet (review, 2026-11-29). Here SIGINT arrives while
    typer is imported, as the console script imports ``infra.cli``."""
    code = ("import builtins, os, signal, sys\n"
            "real = builtins.__import__\n"
            "def importing(name, *args, **kwargs):\n"
            "    if name == 'typer':\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "    return real(name, *args, **kwargs)\n"
            "builtins.__import__ = importing\n"
            "sys.argv = ['rlake', 'status']\n"
            "from infra.cli import main\n"
            "print('imported')\n"
            "sys.exit(main())\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (res.returncode, res.stdout, res.stderr) == (130, "interrupted\n", "")
