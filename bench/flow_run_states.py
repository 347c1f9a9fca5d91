"""What an iteration's flow run costs Prefect's server, by the states it goes through.

    python bench/flow_run_states.py [--runs 100] [--rounds 3]

Against an embedded server of its own (rlake's server settings, ``infra.env``), ``--runs`` flow
runs per configuration and round, interleaved: ``pending_running_completed`` (what rlake sends
today: a run created ahead in Pending, then Running, then Completed) and ``running_completed``
(created in Running, then Completed). Prints the server's CPU (its /proc times) per flow run in
ms for each round, then one JSON line. In async mode that CPU lands on the cores both sides need
(docs/operations.md, "Where async stands").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scratch import scratch_dir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ["PREFECT_HOME"] = scratch_dir("rlake-flow-states-")
    from infra.env import set_offline_defaults

    set_offline_defaults()  # before Prefect's import: it reads its settings then
    from prefect import flow, get_client
    from prefect.client.schemas.actions import FlowRunCreate
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import temporary_settings
    from prefect.states import Completed, Pending, Running, to_state_create

    server = SubprocessASGIServer()
    server.start()
    pid = server.server_process.pid

    def server_cpu_s() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    @flow(name="rl_iteration")
    def iteration(i: int) -> int:
        return i

    with temporary_settings(updates={"api.url": server.api_url}):
        client = get_client(sync_client=True)
        client.__enter__()
        flow_id = client.create_flow(iteration)

        def create(state) -> str:
            body = FlowRunCreate(flow_id=flow_id, parameters={"i": 1}, tags=["rlake-bench"],
                                 state=to_state_create(state))
            return client.request("POST", "/flow_runs/", json=body.model_dump(
                mode="json", exclude_unset=True)).json()["id"]

        def pending_running_completed() -> None:
            run = create(Pending(name="Prefetched"))
            client.set_flow_run_state(run, Running())
            client.set_flow_run_state(run, Completed())

        def running_completed() -> None:
            client.set_flow_run_state(create(Running()), Completed())

        configs = {"pending_running_completed": pending_running_completed,
                   "running_completed": running_completed}
        for fn in configs.values():  # warm: SQLAlchemy's caches, the first inserts
            for _ in range(20):
                fn()
        ms: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(args.rounds):
            for name, fn in configs.items():
                time.sleep(1.0)  # the server's background services settle
                start = server_cpu_s()
                for _ in range(args.runs):
                    fn()
                time.sleep(1.0)  # what the requests left it to do (events)
                ms[name].append(round((server_cpu_s() - start) / args.runs * 1000, 1))
        client.__exit__(None, None, None)
    server.stop()
    for name, values in ms.items():
        print(f"{name:27s} server CPU per flow run (ms): {values}, median {statistics.median(values)}")
    print(json.dumps({"bench": "flow_run_states", "runs": args.runs, "rounds": args.rounds,
                      "server_cpu_ms_per_flow_run": ms}))


if __name__ == "__main__":
    main()
