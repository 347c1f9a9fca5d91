"""The Prefect API round trips an RL iteration waits for, counted against the real embedded
server (bench/flow_requests.py: every request the run's process sends, recorded at httpx).

Before the prefetcher and client settings (flows/prefetch.py, infra/env.py) an iteration sent 8
requests and waited for all of them: a CSRF token, the subflow's tracking task run, a look-up of
an existing subflow run, the flow, the flow run, Running, a read, Completed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

# measured after the change: update (PATCH), Running, read, Completed
MAX_CRITICAL = 4


def test_an_iteration_waits_for_at_most_four_prefect_requests(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PYTHONPATH=str(REPO), PREFECT_HOME=str(tmp_path / "prefect"))
    proc = subprocess.run([sys.executable, "bench/flow_requests.py", "--iterations", "5"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["critical"]) == 4  # iterations 1..4 (the first pays one-off set-up)
    assert max(out["critical"]) <= MAX_CRITICAL, proc.stdout
    # each iteration is still a flow run of its own: created (in the background) and finished
    assert min(out["total"]) >= out["median_critical"] + 2, proc.stdout
