"""bench/cpu.py: the CPU of a run's processes, told apart by role (the benches' per-iteration
CPU figures)."""

from __future__ import annotations

import subprocess
import sys
import time

# busy for 0.5 s of its own CPU, then idle; the last argument only names its role
BUSY = "import time\nwhile time.process_time() < 0.5: pass\ntime.sleep(60)"
SEEN_S = 0.4  # what /proc shows of it at least (its clock ticks round down)


def test_a_childs_cpu_is_counted_under_its_role():
    from bench.cpu import per_iteration_ms, process_tree_cpu

    assert "training_process" in process_tree_cpu()
    child = subprocess.Popen([sys.executable, "-c", BUSY, "infra.tracker_process"])
    try:
        time.sleep(0.2)  # it is a child now, with a first CPU reading
        start = process_tree_cpu()
        assert "mlflow_tracker" in start
        deadline = time.monotonic() + 60
        while process_tree_cpu()["mlflow_tracker"] < SEEN_S and time.monotonic() < deadline:
            time.sleep(0.05)
        end = process_tree_cpu()
    finally:
        child.kill()
        child.wait()
    assert end["mlflow_tracker"] >= SEEN_S
    ms = per_iteration_ms(start, end, 2)
    assert ms["mlflow_tracker"] == 1000 * (end["mlflow_tracker"] - start["mlflow_tracker"]) / 2
    assert ms["total"] == sum(v for k, v in ms.items() if k != "total")
    assert per_iteration_ms(start, end, 0) == {}
