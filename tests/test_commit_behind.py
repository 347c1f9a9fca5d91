"""An iteration commits behind (flows.steps.run_behind): its ``train_steps`` row is written on a
thread of its own while the next iteration generates (sync) or trains (async).

Sync: the next iteration's trajectories are appended only after that row (a resume then never
finds rows of an iteration whose previous step is uncommitted). Async: the weights the step made
reach the rollout side at once, but what it generates with them is appended only after that row
(the lake never holds rows of a version a crash could take back), and the next step's row comes
after it.

The run's ``train_steps`` append is slowed by ``SLOW_S`` (longer than an iteration's generation
or training) so that each order can only hold because something waited for the commit: without
that wait the next rows would land first. The last iteration, one that evaluates and one whose
flow run could not be created ahead (a plain subflow call: Prefect would get its Completed before
the commit) commit inline: their ``record`` phase holds the slow append, the others' does not. So
does a process's first iteration in sync mode (a subflow call too); async mode creates its first
run before it (a top-level run: ``IterationRuns(nested=False)``), so it commits behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime

import pytest

from buffer import Lake
from buffer.delta import GUARDS_KEY
from buffer.maintenance import history
from tests.conftest import REPO
from tests.opshelp import TINY, cli_env

SLOW_S = 1.0
N_ITER = 6
EVAL_AFTER = 3  # iteration 2 evaluates (3 done): it commits inline
REFUSED = 3  # the creation of this iteration's run ahead fails: it runs on a plain subflow call

SCRIPT = f"""
import json, sys, time
from infra.env import configure_environment
from infra.prefect_server import EmbeddedServer

home = sys.argv[1]
configure_environment(home)
server = EmbeddedServer.start(home)  # as `rlake run` does: before Prefect reads its settings
server.wait()

from buffer.lake import Lake

append = Lake.append_train_step
def slow_append(self, row):
    time.sleep({SLOW_S})
    return append(self, row)
Lake.append_train_step = slow_append

from flows.prefetch import IterationRuns
create = IterationRuns._create
def refusing_create(self, parameters, tags):
    if parameters["iteration"] == {REFUSED}:
        raise RuntimeError("the server refused the creation")
    return create(self, parameters, tags)
IterationRuns._create = refusing_create

from flows.rl import rl_run, set_reporter
from infra.config import load_config

cfg = load_config("configs/quickstart.yaml", [f"home={{home}}", "num_rollout={N_ITER}",
                  "eval.eval_interval={EVAL_AFTER}", *sys.argv[2:]])
events = []
set_reporter(lambda event, payload: events.append(payload) if event == "iteration" else None)
try:
    rl_run(cfg.model_dump(), run_id="behind")
finally:
    server.stop()
print(json.dumps([{{k: p.get(k) for k in ("iteration", "time/record", "time/commit_wait")}}
                  for p in events]))
"""


def _commit_times(lake: Lake, table: str, prefix: str) -> dict[int, datetime]:
    """{iteration or step: its newest commit's time} among the table's appends below ``N_ITER``,
    from the Delta log (train rows' guards: an evaluation's rows have their own, ``eval-{v}``)."""
    out: dict[int, datetime] = {}
    for entry in history(lake, table):
        for guard in json.loads(entry.get(GUARDS_KEY) or "[]"):
            last = guard.rsplit("/", 1)[1]
            if not last.isdigit():
                continue
            number = int(last)
            if guard.startswith(prefix) and number < N_ITER:
                when = datetime.fromisoformat(entry["timestamp"])
                out[number] = max(out.get(number, when), when)
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_commit_behind_lands_before_what_depends_on_it(tmp_path, mode):
    home = tmp_path / "home"
    overrides = [TINY[i + 1] for i in range(0, len(TINY), 2)]
    if mode == "async":
        overrides += ["mode=async", "trainer.max_staleness=1"]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(home), *overrides], cwd=REPO,
                          env=cli_env(None, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = {e["iteration"]: e for e in json.loads(proc.stdout.strip().splitlines()[-1])}
    assert sorted(events) == list(range(N_ITER))
    inline = {EVAL_AFTER - 1, REFUSED, N_ITER - 1} | ({0} if mode == "sync" else set())
    assert set(events) - inline == ({1, 4} if mode == "sync" else {0, 1, 4})
    for i, e in events.items():
        # a lower bound, not a timing: an inline commit contains the slow append
        assert (e["time/record"] >= SLOW_S) == (i in inline), (i, e)
    lake = Lake(str(home / "lake"))
    steps = _commit_times(lake, "train_steps", "rlake/train_steps/behind/")
    rollouts = _commit_times(lake, "trajectories", "rlake/trajectories/behind/")
    assert sorted(steps) == sorted(rollouts) == list(range(N_ITER))
    rows = lake.read("train_steps", run_id="behind").to_pylist()
    if mode == "sync":
        for i in range(N_ITER - 1):
            assert steps[i] <= rollouts[i + 1], (i, steps, rollouts)
    else:
        # batch b generated with version w was appended after step w - 1's commit (which made
        # w), though generated meanwhile: the weights come before the commit, the append after
        trajectories = lake.read("trajectories", run_id="behind",
                                 columns=["iteration", "kind", "weight_version", "created_at"])
        made = {}
        for r in trajectories.to_pylist():
            if r["kind"] == "train" and r["iteration"] < N_ITER:
                key = (r["iteration"], r["weight_version"])
                made[key] = min(made.get(key, r["created_at"]), r["created_at"])
        assert 2 in {w for _, w in made}, made  # made by step 1, which ran behind
        for (batch, version) in made:
            if version >= 1:
                assert steps[version - 1] <= rollouts[batch], (batch, version, steps, rollouts)
        # the rollout side generated with a version while its commit (slowed by SLOW_S) ran:
        # rows stamped (created_at, before their append) before that commit landed
        assert any(created.replace(tzinfo=UTC) < steps[version - 1]
                   for (_, version), created in made.items() if version >= 1), (made, steps)
        # the steps after one that committed behind waited for it before their own commit
        for i in set(events) - inline:
            assert "time/commit_wait" in events[i + 1] and \
                events[i + 1]["time/commit_wait"] is not None, events[i + 1]
    # steps committed in order; every step consumed its own iteration's rows, none twice
    assert [r["step"] for r in sorted(rows, key=lambda r: steps[r["step"]])] == list(range(N_ITER))
    consumed = [u for r in rows for u in r["sample_uids"]]
    assert len(consumed) == len(set(consumed))
    assert all(u.split("/")[1] == str(r["iteration"]) for r in rows for u in r["sample_uids"])


APPEND_SLOW_S = 1.0
FAIL = 2  # this iteration's trajectories append raises: the run fails before its commit
N_SLOW = FAIL + 1

# imported by the run's process (sync mode appends there) and, as the target it is told to run,
# by async mode's rollout process (it appends there): both slow every append of train rows
SLOW_APPEND = f"""
import time

from buffer.lake import Lake

append = Lake.append_trajectories
failed = set()


def slow_append(self, rows, commit_info=None):
    kinds = rows.select(["iteration", "kind"]).to_pylist() if hasattr(rows, "select") else rows
    train = {{r["iteration"] for r in kinds if r["kind"] == "train"}}
    if train and not train & failed:  # its retries fail at once
        time.sleep({APPEND_SLOW_S})
    if {FAIL} in train:
        failed.add({FAIL})
        raise RuntimeError("the append of iteration {FAIL} failed")
    return append(self, rows, commit_info)


Lake.append_trajectories = slow_append


def rollout_process_main(spec, inbox, outbox):
    from flows.rollout_side import rollout_process_main as main
    main(spec, inbox, outbox)
"""

SLOW_APPEND_SCRIPT = f"""
import sys
from infra.env import configure_environment
from infra.prefect_server import EmbeddedServer

home = sys.argv[1]
configure_environment(home)
server = EmbeddedServer.start(home)
server.wait()

import slow_append  # noqa: F401 - slows this process's appends
from infra.spawned import SpawnedProcess

run = SpawnedProcess.run
def run_slowed(self, target, spec):
    if target == "flows.rollout_side:rollout_process_main":
        target = "slow_append:rollout_process_main"
    return run(self, target, spec)
SpawnedProcess.run = run_slowed

from flows.rl import rl_run
from infra.config import load_config

cfg = load_config("configs/quickstart.yaml", [f"home={{home}}", "num_rollout={N_SLOW}",
                  "eval.eval_interval=100", *sys.argv[2:]])
try:
    rl_run(cfg.model_dump(), run_id="slow")
finally:
    server.stop()
"""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_step_commits_only_after_its_rows_append_landed(tmp_path, mode):
    """The commit point (docs/design.md): a ``train_steps`` row is written only after the
    trajectories it names landed, although training overlaps their append. Every trajectories
    append of train rows is slowed by ``APPEND_SLOW_S`` (longer than a step's training), so a
    step that did not wait for it would commit first; iteration ``FAIL``'s append raises, which
    must fail the run with no row for that step.

    Guards two mutants of the mutation review, 2026-11-29, which the test above (slowing the
    train_steps append instead) let through: ``train_and_commit`` committing without waiting
    for ``lake_version()`` (flows/steps.py; the row then names rows not in the lake, and a
    failed append still left a row), and a process's first sync iteration reading its slice
    without waiting for its own append (flows/rl.py, ``landed``: step 0 then trained on an
    slice read before its rows landed)."""
    home = tmp_path / "home"
    (tmp_path / "slow_append.py").write_text(SLOW_APPEND)
    overrides = [TINY[i + 1] for i in range(0, len(TINY), 2)]
    if mode == "async":
        overrides += ["mode=async", "trainer.max_staleness=1"]
    proc = subprocess.run([sys.executable, "-c", SLOW_APPEND_SCRIPT, str(home), *overrides],
                          cwd=REPO, env=cli_env(None, PYTHONPATH=f"{REPO}:{tmp_path}"),
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"the run went on past a failed append:\n{out[-3000:]}"

    lake = Lake(str(home / "lake"))
    assert lake.table_version("train_steps") is not None, f"no step committed:\n{out[-3000:]}"
    landed: dict[int, tuple[int, datetime]] = {}  # iteration: (version, time) of its train rows
    for entry in history(lake, "trajectories"):
        for guard in json.loads(entry.get(GUARDS_KEY) or "[]"):
            prefix, _, last = guard.rpartition("/")
            if prefix == "rlake/trajectories/slow" and last.isdigit():
                assert int(last) not in landed, (guard, landed)  # one commit each
                landed[int(last)] = (entry["version"], datetime.fromisoformat(entry["timestamp"]))
    committed = {}  # step: time of its commit
    for entry in history(lake, "train_steps"):
        for guard in json.loads(entry.get(GUARDS_KEY) or "[]"):
            if guard.startswith("rlake/train_steps/slow/"):
                committed[int(guard.rsplit("/", 1)[1])] = datetime.fromisoformat(entry["timestamp"])
    rows = {r["step"]: r for r in lake.read("train_steps", run_id="slow").to_pylist()}
    assert sorted(committed) == sorted(rows)
    # every step before FAIL committed (async: the rollout side's failure may reach the
    # training side during step FAIL - 1, which then fails), none from FAIL on
    assert sorted(rows) in ([list(range(FAIL))] if mode == "sync" else
                            [list(range(FAIL - 1)), list(range(FAIL))]), sorted(rows)
    assert FAIL not in landed
    trajectories = lake.read("trajectories", run_id="slow",
                             columns=["sample_uid", "iteration", "kind"]).to_pylist()
    for step, row in rows.items():
        version, when = landed[step]
        # the row names the trajectories version its rows landed at, and came after it
        assert row["lake_version"] is not None and row["lake_version"] >= version, (step, row["lake_version"], version)
        assert committed[step] >= when, (step, committed[step], when)
        # the step trained on all of its iteration's train rows (each step consumes its whole
        # slice, one iteration's), every one of them in the lake
        train = {t["sample_uid"] for t in trajectories
                 if t["kind"] == "train" and t["iteration"] == step}
        assert train and set(row["sample_uids"]) == train, (step, len(row["sample_uids"]), len(train))
        assert len(row["sample_uids"]) == len(train)
    assert f"the append of iteration {FAIL} failed" in out, out[-3000:]  # and nothing else
