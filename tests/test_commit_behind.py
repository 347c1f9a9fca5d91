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
