"""A Ctrl-C that lands once a flow run is final is not lost (infra/interrupts.py).

Prefect's flow engine swallows a ``KeyboardInterrupt`` raised after the run reached its final
state (its teardown, an ``on_completion`` hook): the flow call returns normally. A run's Ctrl-C
landing there was lost, and the run trained on to its end (a CI run of
tests/test_hardening_run.py, 2026-11-29). Here the SIGINT is sent from the iteration flow's
``on_completion`` hook, which is exactly that moment, with the CLI's SIGINT handler installed,
against rlake's embedded Prefect server (a script in a process of its own)."""

from __future__ import annotations

import json

from tests.test_flow_requests import START_SERVER, _run

INTERRUPTED_IN_TEARDOWN = START_SERVER + """
import signal
from prefect import flow
from flows.durability import drain_prefect_clients
from flows.prefetch import IterationRuns, ahead
from infra.interrupts import flow_call, note_interrupts

note_interrupts()  # as the CLI does

def ctrl_c(flow, flow_run, state):  # the run is Completed: Prefect's teardown
    if flow_run.parameters["i"] == 1:
        os.kill(os.getpid(), signal.SIGINT)

@flow(name="child", on_completion=[ctrl_c])
def child(i: int) -> int:
    return i

out = {"plain": [], "rlake": [], "plain_interrupted": False, "rlake_interrupted": False,
       "single": [], "single_interrupted": False}
try:
    for i in range(3):  # Prefect alone: the interrupt is swallowed, the loop goes on
        out["plain"].append(child(i=i + 10 if i != 1 else 1))
except KeyboardInterrupt:
    out["plain_interrupted"] = True
import infra.interrupts
infra.interrupts._NOTED.clear()  # the first loop's Ctrl-C is spent
try:
    with IterationRuns(child) as runs:
        for i in range(5):
            out["rlake"].append(runs.run({"i": i}, upcoming=ahead(i, 5, lambda j: {"i": j})))
except KeyboardInterrupt:
    out["rlake_interrupted"] = True
infra.interrupts._NOTED.clear()
try:  # one flow called on its own (the SFT warm-up's): its caller stops as it returns
    for i in range(3):
        out["single"].append(flow_call(child, i=i))
except KeyboardInterrupt:
    out["single_interrupted"] = True
try:
    print(json.dumps(out))
finally:
    drain_prefect_clients()
    server.stop()
"""


def test_a_ctrl_c_prefect_swallowed_still_stops_the_iterations(tmp_path):
    out = json.loads(_run(["-c", INTERRUPTED_IN_TEARDOWN], tmp_path).strip().splitlines()[-1])
    # Prefect's behaviour, which the guard exists for: the call after the Ctrl-C returned
    assert out["plain"] == [10, 1, 12] and not out["plain_interrupted"], out
    # rlake's iterations stop at the iteration the Ctrl-C came in
    assert out["rlake"] == [0] and out["rlake_interrupted"], out
    # a single flow call (``flow_call``: the SFT warm-up's) stops its caller as it returns
    assert out["single"] == [0] and out["single_interrupted"], out
