"""The tracker's background sender (infra.tracking._Sender) against a real MLflow SQLite store:
what is queued within a round goes in one ``log_batch`` (whole steps, at most 1000 metrics a
call), calls queued between metrics still run, and ``flush`` sends what was gathered."""

from __future__ import annotations

from infra.tracking import BATCH_LIMIT, Tracker


def _counting_log_batch(tracker: Tracker) -> list[int]:
    """The number of metrics of each real ``log_batch`` call the sender makes with metrics."""
    calls: list[int] = []
    real = tracker.client.log_batch

    def log_batch(run_id, metrics=(), **kwargs):
        if metrics:
            calls.append(len(metrics))
        return real(run_id, metrics=metrics, **kwargs)
    tracker.client.log_batch = log_batch
    return calls


def test_steps_queued_within_a_round_go_in_one_log_batch_and_whole_steps_per_call(tmp_path):
    tracker = Tracker(tmp_path)
    tracker._sender.linger_s = 60.0  # the round ends at the flush, not by time
    run_id = tracker.start("r", params={}, tags={"rlake.run_id": "r"})
    calls = _counting_log_batch(tracker)
    for step in range(20):
        tracker.log_metrics({"x": float(step), "weight_version": float(step + 1)}, step)
        tracker.register_weight_version_later("r", step + 1, {"iteration": step})
    tracker.flush()
    assert calls == [40], "20 steps queued in one round: one log_batch"
    assert tracker.logged_steps("weight_version") == set(range(20))
    assert tracker.registered_weight_versions("r") == set(range(1, 21))

    # steps of 600 metrics: a call holds whole steps only (a crash between two calls leaves a
    # step logged entirely or not at all, which the resume's re-logging relies on)
    calls.clear()
    wide = {f"m{i}": float(i) for i in range(599)}
    for step in range(20, 23):
        tracker.log_metrics({**wide, "weight_version": float(step + 1)}, step)
    tracker.flush()
    assert calls == [600, 600, 600] and all(n <= BATCH_LIMIT for n in calls)
    history = tracker.client.get_metric_history(run_id, "m598")
    assert sorted(m.step for m in history) == [20, 21, 22]
    tracker.finish()
