"""Async mode's rollout side, in its own process: generate, score and append batch after batch.

    loop b = next batch (from the lake) .. num_rollout - 1:
        take the newest weights the training side sent (version w)
        wait while b - w > k                      (AReaL's bound: batch b is trained at version b)
        rollout_batch(b)                          (a Prefect task run named rollout_batch-b)
          generate -> score -> send the rows to the training side ("rows", b, stats, rows)
          -> wait until version w is committed    (its train_steps row landed)
          -> lake commit                          (the training side trains meanwhile)
        tell the training side "b appended" at Delta version n

The weights of a step come as soon as it has trained, before its commit (which runs behind): the
batch generated with them overlaps that commit, and only its append waits for it, so the lake
never holds rows of a version that a crash could take back.

Batch b is the one training iteration b consumes (oldest first, one batch per iteration), so the
wait keeps every trained sample within k versions of the trainer, after a resume too: the next
batch and the data position are read back from the lake (``infra.sides.resume_position``), and
the first weights are the committed version the training side resumed from.

The process is spawned when the run's runtime opens, and has imported torch and the lake by the
time it is told to run ``rollout_process_main`` (infra/spawned.py: it dies with its parent).
"""

from __future__ import annotations

import os
import queue
import traceback
from functools import partial
from typing import Any

BATCH_TAG = "rlake-batch:{}"


def batch_tag(batch: int) -> str:
    """The Prefect tag of the iteration that trains on rollout batch ``batch``."""
    return BATCH_TAG.format(batch)


class Mailbox:
    """Messages from the training side: ("weights", version, payload), ("committed", version)
    once that version's ``train_steps`` row has landed, and ("stop",). Keeps only the newest
    weights and the newest committed version; ``parent_pid`` gone ends the process (a last guard
    besides PDEATHSIG)."""

    def __init__(self, inbox, parent_pid: int) -> None:
        self.inbox, self.parent_pid = inbox, parent_pid
        self.version, self.payload, self.stopped = -1, None, False
        self.committed = -1

    def _take(self, message: tuple) -> None:
        if message[0] == "stop":
            self.stopped = True
        elif message[0] == "committed":
            self.committed = max(self.committed, message[1])
        elif message[1] > self.version:
            self.version, self.payload = message[1], message[2]

    def poll(self, timeout: float | None = None) -> None:
        """Take every waiting message; with ``timeout``, first wait up to that long for one."""
        try:
            if timeout is not None:
                self._take(self.inbox.get(timeout=timeout))
            while True:
                self._take(self.inbox.get_nowait())
        except queue.Empty:
            pass
        if os.getppid() != self.parent_pid:
            os._exit(1)

    def wait_for(self, min_version: int) -> None:
        """Block until weights of at least ``min_version`` arrived (or stop)."""
        self.poll()
        while self.version < min_version and not self.stopped:
            self.poll(timeout=1.0)

    def wait_committed(self, version: int) -> bool:
        """Block until ``version`` is committed; False if the training side stopped first."""
        self.poll()
        while self.committed < version and not self.stopped:
            self.poll(timeout=1.0)
        return self.committed >= version


def produce(side, mailbox: Mailbox, outbox, stop_at: int) -> None:
    """The loop of the module docstring (runs inside the ``rollout_side`` flow)."""

    from infra.env import freeze_startup_heap
    from tasks.async_batches import rollout_batch

    k = side.cfg.trainer.max_staleness
    batch = side.next_batch
    while batch < stop_at:
        mailbox.wait_for(max(0, batch - k))
        if mailbox.stopped:
            return
        if mailbox.payload is not None:  # newest weights, loaded once
            side.load_weights(mailbox.payload, mailbox.version)
            mailbox.payload = None
        side.seed_batch(batch)

        def send_rows(stats: dict, rows, batch: int = batch) -> None:
            outbox.put(("rows", batch, stats, rows))

        # named after its batch (BATCH_RUN_NAME), untagged (flows.prefetch.untagged says why);
        # its append waits until the weights it was generated with are committed
        _, lake_version = rollout_batch(side, batch, send_rows,
                                        partial(mailbox.wait_committed, side.engine.weight_version))
        if mailbox.stopped:  # the run ended before the batch's version was committed
            return
        outbox.put(("appended", batch, lake_version))
        # once, after the first batch: its collection (~0.15 s) then overlaps the training
        # side's first step instead of delaying the batch that step waits for
        freeze_startup_heap()
        batch += 1


def rollout_process_main(spec: dict[str, Any], inbox, outbox) -> None:
    """What the spawned process runs (``infra.spawned.SpawnedProcess.run``): ``spec`` =
    {config, run_id, version, parent_pid, api_url, run_tag}. Reports ("ready", next batch),
    ("rows", b, stats, rows), ("appended", b, Delta version or None), ("error", text)."""
    if spec.get("api_url"):  # read by Prefect at its import: before it, if not imported yet
        os.environ["PREFECT_API_URL"] = spec["api_url"]
    try:
        from prefect import flow, tags
        from prefect.settings import temporary_settings

        from flows.prefetch import untagged
        from infra.config import config_from_dict
        from infra.sides import open_rollout_side

        cfg = config_from_dict(spec["config"])
        side = open_rollout_side(cfg, spec["run_id"], spec["version"])
        outbox.put(("ready", side.next_batch))
        mailbox = Mailbox(inbox, spec["parent_pid"])

        @flow(name="rollout_side")
        def rollout_side(run_id: str, first_batch: int) -> None:
            with untagged():  # the flow run carries the run's tag; its batches need none
                produce(side, mailbox, outbox, cfg.num_rollout)

        settings = {"flows.heartbeat_frequency": None}
        if spec.get("api_url"):  # Prefect imported before the run was told where its API is
            settings["api.url"] = spec["api_url"]
        with temporary_settings(updates=settings), tags(spec["run_tag"]):
            rollout_side(spec["run_id"], side.next_batch)
    except BaseException:
        outbox.put(("error", traceback.format_exc()))
        raise
