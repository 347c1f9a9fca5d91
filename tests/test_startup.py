"""Startup through the real CLI (issue 16.1, 16.3, 16.4, 16.8): an existing run id is refused
before anything of it changes; a kill -9 in the first seconds leaves a run `rlake resume`
finishes, with nothing left RUNNING; two first runs on one fresh home both finish; a bad prompt
file fails before Prefect starts, in one line; a run whose Prefect server ends under it stops
at once, in one line, and resumes."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.recovery import prefect_servers
from tests.opshelp import ROOT, TINY, cli_env, rlake, tail

FAST = [*TINY, "--set", "num_rollout=1", "--set", "eval.eval_interval=1"]


def _args(home: Path, run_id: str, *extra: str) -> list[str]:
    return ["run", "--set", f"home={home}", "--set", f"run_id={run_id}", *FAST, *extra]


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _mlflow_runs(home: Path, run_id: str) -> list[tuple[str, str]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home}/mlflow/mlflow.db")
    exp = client.get_experiment_by_name("rlake")
    return sorted((r.info.run_id, r.info.status) for r in
                  client.search_runs([exp.experiment_id], f"tags.`rlake.run_id` = '{run_id}'"))


def _flow_run_states(home: Path) -> list[tuple[str, str]]:
    """(tags, state) of every flow run in the home's Prefect database (read directly: the
    server that wrote it is gone)."""
    with sqlite3.connect(home / "prefect" / "prefect.db") as con:
        return con.execute("SELECT tags, state_type FROM flow_run").fetchall()


def _error_lines(log: Path) -> list[str]:
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    return [line for line in text.splitlines() if line.startswith("error:")]


def _no_server_left(home: Path) -> None:
    deadline = time.monotonic() + 30
    while prefect_servers(home / "prefect") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert prefect_servers(home / "prefect") == [], "a Prefect server outlived its run"


def test_existing_run_id_is_refused_before_anything_changes(tmp_path):
    from buffer import Lake

    home = tmp_path / "home"
    first = rlake(_args(home, "once"), cli_env(None), tmp_path / "first.log")
    assert first.returncode == 0, tail(tmp_path / "first.log")
    lake = Lake(str(home / "lake"))
    row = lake.get_run("once")
    checkpoints = _digest(home / "runs" / "once" / "checkpoints")
    assert "v000000/config.json" in checkpoints
    mlflow_runs = _mlflow_runs(home, "once")
    assert [s for _, s in mlflow_runs] == ["FINISHED"]
    for i, args in enumerate((_args(home, "once"),
                              ["run", "--run-id", "once", "--set", f"home={home}", *FAST])):
        log = tmp_path / f"again-{i}.log"
        again = rlake(args, cli_env(None), log)
        assert again.returncode == 1, tail(log)
        (line,) = _error_lines(log)
        assert "run 'once' already exists (status completed)" in line
        assert f"rlake resume once --home {home}" in line
    # from Python too (a script, a notebook): a new run or a replay under the id is refused
    from flows.replay import rl_replay
    from flows.rl import run_pipeline
    from infra.config import config_from_dict
    from infra.startup import StartupError

    config = {**json.loads(row["config"]), "home": str(home)}
    with pytest.raises(StartupError, match="run 'once' already exists"):
        run_pipeline(config_from_dict(config), "once", resume=False)
    with pytest.raises(StartupError, match="run 'once' already exists"):
        rl_replay.fn("once", config, run_id="once")
    assert lake.get_run("once") == row, "the runs row changed"
    assert _digest(home / "runs" / "once" / "checkpoints") == checkpoints, "checkpoints changed"
    assert _mlflow_runs(home, "once") == mlflow_runs, "MLflow runs changed"


def test_kill9_in_the_first_seconds_then_resume_finishes(tmp_path):
    from buffer import Lake

    home = tmp_path / "home"
    # 1. killed right after the run is recorded: nothing else exists yet
    log = tmp_path / "crash-0.log"
    proc = rlake(_args(home, "early"), cli_env(None, RLAKE_FAULT="after_run_recorded"), log)
    assert proc.returncode == -signal.SIGKILL, tail(log)
    row = Lake(str(home / "lake")).get_run("early")
    assert row is not None and row["status"] == "running", "the run was not recorded first"
    assert json.loads(row["config"])["num_rollout"] == 1
    # 2. resumed, killed once the runtime is open and Prefect's server answers: the server
    #    must not outlive the process
    log = tmp_path / "crash-1.log"
    proc = rlake(["resume", "early", "--home", str(home)],
                 cli_env(None, RLAKE_FAULT="before_first_flow"), log)
    assert proc.returncode == -signal.SIGKILL, tail(log)
    _no_server_left(home)
    # 3. resumed, killed inside the first iteration: flow runs and the MLflow run are RUNNING
    log = tmp_path / "crash-2.log"
    proc = rlake(["resume", "early", "--home", str(home)],
                 cli_env(None, RLAKE_FAULT="during_generate:0"), log)
    assert proc.returncode == -signal.SIGKILL, tail(log)
    _no_server_left(home)
    assert [s for _, s in _mlflow_runs(home, "early")] == ["RUNNING"]
    assert "RUNNING" in {s for _, s in _flow_run_states(home)}
    # 4. the final resume finishes and leaves nothing RUNNING
    log = tmp_path / "final.log"
    done = rlake(["resume", "early", "--home", str(home)], cli_env(None), log)
    assert done.returncode == 0, tail(log)
    assert Lake(str(home / "lake")).get_run("early")["status"] == "completed"
    assert [s for _, s in _mlflow_runs(home, "early")] == ["FINISHED"], "one MLflow run, continued"
    states = _flow_run_states(home)
    assert all("rlake-run:early" in tags for tags, _ in states), states
    assert not [s for _, s in states if s in ("RUNNING", "PENDING")], states
    assert [s for _, s in states].count("CRASHED") >= 2, states
    _no_server_left(home)


def test_two_first_runs_on_a_fresh_home_both_finish(tmp_path):
    home = tmp_path / "home"  # does not exist yet: both create the lake, MLflow and Prefect DBs
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [rlake(_args(home, name), cli_env(None), log, background=True)
             for name, log in zip(("a", "b"), logs, strict=True)]
    for proc, log in zip(procs, logs, strict=True):
        assert proc.wait(timeout=1200) == 0, tail(log)
    for name in ("a", "b"):
        assert [s for _, s in _mlflow_runs(home, name)] == ["FINISHED"]
    _no_server_left(home)


def test_bad_prompt_file_fails_before_prefect_starts(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n\n{"prompt": "2+2=", "label": \n')
    home = tmp_path / "home"
    log = tmp_path / "bad.log"
    proc = rlake(_args(home, "bad", "--set", f"data.prompt_data={data}"), cli_env(None), log,
                 timeout=300)
    assert proc.returncode == 1, tail(log)
    (line,) = _error_lines(log)
    assert f"{data}:line 3: malformed JSON" in line
    # nothing slow started: no Prefect database or server, no MLflow store, no run recorded
    assert not (home / "prefect" / "prefect.db").exists()
    assert not (home / "prefect" / "embedded-server.log").exists()
    assert not (home / "mlflow").exists()
    assert not (home / "lake" / "runs").exists()


def test_resume_of_an_unknown_run_is_one_line(tmp_path):
    log = tmp_path / "resume.log"
    proc = rlake(["resume", "nosuchrun", "--home", str(tmp_path / "home")], cli_env(None), log,
                 timeout=300)
    assert proc.returncode == 1, tail(log)
    (line,) = _error_lines(log)
    assert "no run 'nosuchrun' in the lake" in line
    assert not (tmp_path / "home" / "prefect" / "prefect.db").exists()


def test_a_fresh_home_starts_from_the_cached_databases(tmp_path):
    """The first run on a machine (an empty cache) leaves its Prefect database as the template
    (infra/prefect_db.py) and builds an empty MLflow one there (infra/tracking.py); the next
    fresh home gets copies of both (seen by marker tables put into the templates) and its run
    is recorded in them as usual."""
    from infra.prefect_db import template_path

    cache = tmp_path / "cache"
    env = cli_env(None, RLAKE_CACHE_DIR=str(cache))
    first = rlake(_args(tmp_path / "home1", "first"), env, tmp_path / "first.log")
    assert first.returncode == 0, tail(tmp_path / "first.log")
    (template,) = (cache / "prefect-db").glob("*.db")
    import importlib.metadata

    assert f"prefect-{importlib.metadata.version('prefect')}" in template.name
    con = sqlite3.connect(template)  # the template is a migrated Prefect database
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # one file, no -wal
    assert con.execute("SELECT count(*) FROM block_type").fetchone()[0] > 0
    assert con.execute("SELECT count(*) FROM flow_run").fetchone()[0] == 0
    con.execute("CREATE TABLE rlake_marker (x INTEGER)")
    con.commit()
    con.close()
    (mlflow_template,) = (cache / "mlflow-db").glob("*.db")
    with sqlite3.connect(mlflow_template) as con:  # migrated, and empty: no home's experiment
        assert con.execute("SELECT version_num FROM alembic_version").fetchone()
        assert con.execute("SELECT count(*) FROM experiments").fetchone()[0] == 0
        con.execute("CREATE TABLE rlake_marker (x INTEGER)")
    second = rlake(_args(tmp_path / "home2", "second"), env, tmp_path / "second.log")
    assert second.returncode == 0, tail(tmp_path / "second.log")
    for db in ("prefect/prefect.db", "mlflow/mlflow.db"):
        with sqlite3.connect(tmp_path / "home2" / db) as con:
            assert con.execute("SELECT name FROM sqlite_master WHERE name = 'rlake_marker'"
                               ).fetchone(), db
    with sqlite3.connect(tmp_path / "home2" / "mlflow" / "mlflow.db") as con:
        assert con.execute("SELECT count(*) FROM runs WHERE name = 'second'").fetchone()[0] == 1
        assert con.execute("SELECT count(*) FROM metrics").fetchone()[0] > 0
    states = _flow_run_states(tmp_path / "home2")
    assert states and {s for _, s in states} == {"COMPLETED"}, states
    assert template_path().parent != cache / "prefect-db"  # this process's cache is the session's


def _committed_steps(home: Path, run_id: str) -> int:
    from buffer import Lake

    try:
        return len(Lake(str(home / "lake")).read("train_steps", run_id=run_id))
    except Exception:  # noqa: BLE001 - the table does not exist yet
        return 0


def _lose_server_mid_run(home: Path, args: list[str], log: Path, stop) -> subprocess.Popen:
    """Start ``rlake ARGS``, call ``stop()`` once it has committed a step past the ones already
    committed, and return the process once it ended (a hang guard, not a timing)."""
    before = _committed_steps(home, "lost")
    proc = rlake(args, cli_env(None), log, background=True)
    while _committed_steps(home, "lost") <= before:
        assert proc.poll() is None, tail(log)
        time.sleep(0.2)
    stop()
    proc.wait(timeout=120)
    return proc


def test_a_run_whose_prefect_server_ends_stops_at_once_and_resume_finishes(tmp_path):
    """The server a run uses ends under it: the home's (as when its `rlake serve` stops), then a
    resume's own embedded one (killed). Each time the run ends with one error line saying how
    to continue (it hung for minutes before, retrying every Prefect call), and nothing after it
    (multiprocessing's resource tracker warned of "leaked semaphore objects", async mode's
    queues', under it); the final resume trains every iteration exactly once. The run is in
    async mode: its rollout process and its queues are what must end with it."""
    from buffer import Lake
    from infra.prefect_server import ensure_server, stop_server

    home = tmp_path / "home"
    # far more iterations than run before the server's loss is seen (3-4 here, 2026-11-28: its
    # watch checks every 0.5 s); no evaluation between (the resumes would repeat each one)
    n = 30
    ensure_server(home)  # what `rlake serve` starts: the run finds it and uses it
    log = tmp_path / "lost-0.log"
    proc = _lose_server_mid_run(home, _args(home, "lost", "--set", f"num_rollout={n}",
                                            "--set", f"eval.eval_interval={n}", "--set", "mode=async",
                                            "--set", "trainer.max_staleness=1"), log,
                                lambda: stop_server(home))
    assert proc.returncode == 1, tail(log)
    [line] = _error_lines(log)
    assert "the home's Prefect server" in line and "ended while run lost ran" in line, line
    assert f"`rlake resume lost --home {home}` continues it" in line, line
    assert _committed_steps(home, "lost") < n

    def kill_embedded() -> None:
        [server] = prefect_servers(home / "prefect")
        os.kill(server, signal.SIGKILL)

    log = tmp_path / "lost-1.log"
    proc = _lose_server_mid_run(home, ["resume", "lost", "--home", str(home)], log, kill_embedded)
    assert proc.returncode == 1, tail(log)
    [line] = _error_lines(log)
    assert "its Prefect server" in line and "ended while run lost ran" in line, line
    committed = _committed_steps(home, "lost")
    assert committed < n
    log = tmp_path / "final.log"
    done = rlake(["resume", "lost", "--home", str(home)], cli_env(None), log)
    assert done.returncode == 0, tail(log)
    lake = Lake(str(home / "lake"))
    assert lake.get_run("lost")["status"] == "completed"
    steps = sorted(s["step"] for s in lake.read("train_steps", run_id="lost").to_pylist())
    assert steps == list(range(n)), "an iteration trained twice or never"
    uids = [r["sample_uid"] for r in lake.read("trajectories", run_id="lost",
                                               columns=["sample_uid"]).to_pylist()]
    assert len(uids) == len(set(uids)), "a sample written twice"
    _no_server_left(home)
    for name in ("lost-0.log", "lost-1.log"):  # read last: the tracker would print after the exit
        assert "leaked" not in (tmp_path / name).read_text(), tail(tmp_path / name)


def test_prefects_queued_logs_reach_the_server_before_it_stops(tmp_path):
    """At DEBUG, Prefect's client still queued log records when the run stopped its embedded
    server; its exit hook then sent them to the stopped server, retrying each batch ~60 s
    (77 s to exit a 10 s run). They go before the server stops now: nothing is retried."""
    home = tmp_path / "home"
    log = tmp_path / "debug.log"
    proc = rlake(_args(home, "dbg"), cli_env(None, PREFECT_LOGGING_LEVEL="DEBUG"), log, timeout=600)
    assert proc.returncode == 0, tail(log)
    text = log.read_text()
    assert "| DEBUG   |" in text, "Prefect's DEBUG logging was not on"
    assert "retryable exception during request" not in text, tail(log)
    assert "All connection attempts failed" not in text, tail(log)


def test_unreadable_model_files_are_named(tiny, tmp_path):
    """A corrupt or truncated weights file, or a tokenizer.json / config.json that is not JSON,
    is found by the start-up check (before the run is recorded), naming the file; a whole
    folder passes."""
    import shutil

    from infra.startup import unreadable_model_file

    path, _ = tiny
    assert unreadable_model_file(path) is None
    weights = (path / "model.safetensors").read_bytes()
    for name, content, expected in (
            ("model.safetensors", weights[:len(weights) // 2], "cannot read the weights file"),
            ("model.safetensors", weights[:1000], "cannot read the weights file"),
            ("tokenizer.json", b'{"model": ', "is not valid JSON"),
            ("config.json", b"\xff\xfe", "is not valid JSON")):
        broken = tmp_path / f"broken-{name}-{len(content)}"
        shutil.copytree(path, broken)
        (broken / name).write_bytes(content)
        why = unreadable_model_file(broken)
        assert why is not None and expected in why and str(broken / name) in why, why


def test_a_model_that_fails_to_load_after_the_run_is_recorded_says_how_to_go_on(tiny, tmp_path):
    """Weights whose shapes do not match config.json pass the start-up check (their header is
    whole) and fail as the model loads, after the run was recorded: the error says the run is
    recorded as failed and that `rlake resume` starts it, and it does once the folder is mended."""
    import shutil

    from buffer import Lake

    path, _ = tiny
    model, home = tmp_path / "model", tmp_path / "home"
    shutil.copytree(path, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    args = ["run", "--set", f"home={home}", "--run-id", "shapes", *FAST,
            "--set", "sft.enabled=false", "--set", f"model.path={model}"]
    log = tmp_path / "run.log"
    assert rlake(args, cli_env(None, COLUMNS="1000"), log).returncode == 1, tail(log)
    (line,) = _error_lines(log)
    assert "size mismatch" in log.read_text()
    assert "run 'shapes' is recorded as failed" in line
    assert (f"`rlake run CONFIG --run-id shapes --home {home}` starts it again under this id): "
            "Error(s) in loading") in line
    assert Lake(str(home / "lake")).get_run("shapes")["status"] == "failed"
    (model / "config.json").write_text(json.dumps(config))
    done = rlake(["resume", "shapes", "--home", str(home)], cli_env(None), tmp_path / "resume.log")
    assert done.returncode == 0, tail(tmp_path / "resume.log")
    assert Lake(str(home / "lake")).get_run("shapes")["status"] == "completed"


def test_data_check_reads_eval_sets_as_they_are_built_and_each_rows_reward(tmp_path):
    """A row's metadata rm_type was never checked: an unknown one failed its samples every
    iteration behind one warning. An eval set's file was checked without data.tool_key, which
    its build uses: the run was recorded, then failed (review, 2026-11-29)."""
    from infra.config import load_config
    from infra.startup import StartupError, check_data

    prompts, evals = tmp_path / "p.jsonl", tmp_path / "e.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in (
        {"prompt": "1+1=", "label": "2", "meta": {"rm_type": "math"}, "tools": []},
        {"prompt": "2+2=", "label": "4", "meta": {"rm_type": "matth"}, "tools": []})))
    evals.write_text(json.dumps({"prompt": "3+3=", "label": "6", "meta": {}}) + "\n")
    base = [f"data.prompt_data={prompts}", "data.metadata_key=meta"]
    with pytest.raises(StartupError, match=rf"{prompts}:line 2: metadata rm_type: unknown rm_type 'matth'"):
        check_data(load_config(None, base))
    prompts.write_text(prompts.read_text().replace("matth", "math"))
    check_data(load_config(None, base))
    with pytest.raises(ValueError, match=rf"{evals}:line 1: missing key 'tools'"):
        check_data(load_config(None, [*base, "data.tool_key=tools",
                                      f"eval.datasets=[{{name: e, path: {evals}}}]"]))


def test_resume_refuses_a_prompt_file_changed_since_the_run_started(tmp_path):
    """The data position counts prompts in the file's order: a resume after the file changed
    went on in other rows without a word (review, 2026-11-29)."""
    from buffer import Lake

    home, prompts = tmp_path / "home", tmp_path / "p.jsonl"
    rows = [{"prompt": f"{a}+{a}=", "label": str(2 * a)} for a in range(10, 30)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = tmp_path / "run.log"
    proc = rlake(["run", "--set", f"home={home}", "--run-id", "data", *TINY, "--set", "sft.enabled=false",
                  "--set", "num_rollout=3", "--set", f"data.prompt_data={prompts}"],
                 cli_env(None, RLAKE_FAULT="after_lake_append:1"), log)
    assert proc.returncode != 0 and Lake(str(home / "lake")).get_run("data")["status"] == "running"
    original = prompts.read_text()
    prompts.write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))
    log = tmp_path / "resume.log"
    assert rlake(["resume", "data", "--home", str(home)], cli_env(None), log).returncode == 1
    (line,) = _error_lines(log)
    assert f"run 'data': data.prompt_data {prompts} changed since the run started" in line
    prompts.write_text(original)
    done = rlake(["resume", "data", "--home", str(home)], cli_env(None), tmp_path / "again.log")
    assert done.returncode == 0, tail(tmp_path / "again.log")


def test_resume_command_is_shell_quoted(tmp_path):
    """A home with a space gave a printed `rlake resume` that did not run (review, 2026-11-29)."""
    import shlex

    from infra.config import RunConfig
    from infra.startup import resume_command

    home = str(tmp_path / "home with space")
    cmd = resume_command("r1", RunConfig(home=home, lake_uri="/x/my lake"))
    assert shlex.split(cmd) == ["rlake", "resume", "r1", "--home", home, "--lake", "/x/my lake"]
    assert resume_command("r1", RunConfig()) == "rlake resume r1"


def test_an_empty_run_id_is_refused(tmp_path):
    """``--run-id ""`` (an unset ``$ID``) started a run under a made-up id (review, 2026-11-29)."""
    from tests.conftest import run_cli

    res = run_cli(["run", "--set", f"home={tmp_path}", "--run-id", ""], check=False, timeout=300)
    assert res.returncode == 1 and "--run-id: run id '' is not allowed" in res.stderr, res.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_new_run_names_its_id_before_it_is_recorded(monkeypatch):
    """A Ctrl-C during start-up (run recorded, runtime starting) printed ``rlake resume RUN_ID``:
    ``started`` ran only once the run was prepared (review, 2026-11-29)."""
    import infra.startup
    from infra.config import RunConfig
    from infra.progress import run_with_progress

    seen = []

    def interrupted_start(cfg, run_id, resume, num_rollout=None):  # Ctrl-C while the run is prepared
        seen.append(("prepared", run_id))
        raise KeyboardInterrupt

    monkeypatch.setattr(infra.startup, "prepared_run", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        run_with_progress(RunConfig(), None, resume=False, console=None,
                          started=lambda run_id: seen.append(("started", run_id)))
    assert [s[0] for s in seen] == ["started", "prepared"] and seen[0][1] == seen[1][1]
    assert seen[0][1] is not None


def test_a_run_is_recorded_with_its_local_paths_absolute(tmp_path, monkeypatch):
    """``rlake resume`` reads the recorded config: a relative model.path or prompt file,
    recorded as given, named files under the folder the resume ran in (review, 2026-11-29)."""
    from buffer import Lake
    from infra.config import RunConfig
    from infra.startup import record_run

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    cfg = RunConfig(home="h", model={"path": "models/m"},
                    data={"prompt_data": "data/p.jsonl@[0:8]", "task": None},
                    rollout={"custom_rm_path": "tests.opshelp:length_reward"})
    lake = Lake(str(tmp_path / "lake"))
    record_run(lake, cfg, "r")
    recorded = json.loads(lake.get_run("r")["config"])
    assert recorded["home"] == str(tmp_path / "h")
    assert recorded["model"]["path"] == str(tmp_path / "models" / "m")
    assert recorded["data"]["prompt_data"] == f"{tmp_path / 'data' / 'p.jsonl'}@[0:8]"
    assert recorded["rollout"]["custom_rm_path"] == "tests.opshelp:length_reward"
    assert RunConfig.model_validate(recorded).num_rollout == cfg.num_rollout


# Writes, in order and with the writer's pid, the first import of the lake's heavy modules and
# the spawn of Prefect's server (the audit events Python raises for both).
ORDER_HOOK = """
import os, sys
_log = open(os.environ["RLAKE_TEST_ORDER_LOG"], "a")
def _hook(event, args):
    if event == "import" and args[0] in ("pyarrow", "deltalake", "duckdb", "torch"):
        _log.write(f"{os.getpid()} import {args[0]}\\n"); _log.flush()
    elif event == "subprocess.Popen" and "infra.prefect_app:create_app" in " ".join(map(str, args[1] or [])):
        _log.write(f"{os.getpid()} server\\n"); _log.flush()
sys.addaudithook(_hook)
"""


def test_a_new_run_spawns_prefects_server_before_it_imports_the_lake(tmp_path):
    """The server's ~4 s start is the startup's path: a new run spawns it before its process
    imports pyarrow or deltalake (~0.4 s), and importing the CLI imports neither (it did, for
    the lake commands' option defaults: the server started ~0.5 s later)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(ORDER_HOOK)
    order = tmp_path / "order.log"
    env = cli_env(None, PYTHONPATH=str(hook), RLAKE_TEST_ORDER_LOG=str(order))
    proc = subprocess.run([sys.executable, "-c", "import infra.cli"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert order.read_text() == "", "importing the CLI imported: " + order.read_text()
    home = tmp_path / "home"
    log = tmp_path / "run.log"
    assert rlake(_args(home, "order"), env, log).returncode == 0, tail(log)
    lines = order.read_text().splitlines()
    (spawned,) = [line for line in lines if line.endswith(" server")]
    pid = spawned.split()[0]
    mine = [line.split(" ", 1)[1] for line in lines if line.split()[0] == pid]
    first = mine.index("server")
    assert {"import pyarrow", "import deltalake", "import torch"} <= set(mine[first:]), mine
    assert not [e for e in mine[:first] if e.startswith("import ")], mine
