"""Staleness slices: exactly the rows a plain filter over the whole table gives, never a consumed one."""

from __future__ import annotations

import tempfile

import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from buffer import Lake, slice_lake_version
from buffer.synth import synthetic_rows

batch = st.tuples(
    st.sampled_from(["run-a", "run-b"]),   # run_id
    st.integers(0, 6),                     # weight_version
    st.sampled_from(["train", "eval"]),    # kind
    st.integers(1, 6),                     # rows
)


def expected(lake: Lake, run_id: str, lo: int, hi: int | None, consumed: set[str]) -> list[str]:
    """The plain filter over a full read of the table."""
    rows = lake.read("trajectories").to_pylist()
    keep = [r for r in rows if r["run_id"] == run_id and r["kind"] == "train"
            and r["weight_version"] >= lo and (hi is None or r["weight_version"] <= hi)
            and r["sample_uid"] not in consumed]
    keep.sort(key=lambda r: (r["weight_version"], r["iteration"], r["sample_index"]))
    return [r["sample_uid"] for r in keep]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batches=st.lists(batch, min_size=1, max_size=6),
    steps=st.lists(st.tuples(st.integers(0, 8), st.randoms(use_true_random=False)), max_size=3),
    lo=st.integers(0, 7),
    span=st.one_of(st.none(), st.integers(0, 4)),
    run_id=st.sampled_from(["run-a", "run-b"]),
    limit=st.one_of(st.none(), st.integers(0, 10)),
)
def test_slice_matches_plain_filter(batches, steps, lo, span, run_id, limit):
    with tempfile.TemporaryDirectory() as tmp:
        lake = Lake(tmp)
        for it, (rid, version, kind, n) in enumerate(batches):
            lake.append_trajectories(synthetic_rows(rid, it, n, weight_version=version, kind=kind))
        # train steps consume random subsets of the run's samples; a step's base_version is at
        # least the version of every sample it consumes (a policy trains on its own or older samples)
        pool = lake.read("trajectories", run_id=run_id, columns=["sample_uid", "weight_version"]).to_pylist()
        consumed: set[str] = set()
        for step, (extra, rnd) in enumerate(steps):
            picked = [r for r in pool if rnd.random() < 0.5]
            base = max([r["weight_version"] for r in picked], default=0) + extra
            lake.append_train_step({"run_id": run_id, "step": step, "base_version": base,
                                    "weight_version": base + 1,
                                    "sample_uids": [r["sample_uid"] for r in picked]})
            consumed |= {r["sample_uid"] for r in picked}
        hi = None if span is None else lo + span
        got = lake.training_slice(run_id, lo, hi, limit=limit)
        want = expected(lake, run_id, lo, hi, consumed)
        assert got.column("sample_uid").to_pylist() == (want if limit is None else want[:limit])
        assert not set(got.column("sample_uid").to_pylist()) & consumed
        assert slice_lake_version(got) == lake.table_version("trajectories")
        everything = lake.training_slice(run_id, lo, hi, unconsumed_only=False)
        assert everything.column("sample_uid").to_pylist() == expected(lake, run_id, lo, hi, set())
        if everything.num_rows:
            assert pc.all(pc.equal(everything.column("kind"), "train")).as_py()


def test_slice_reads_only_matching_files(tmp_path):
    """File pruning: a slice opens only the files whose Delta statistics can match."""
    lake = Lake(str(tmp_path))
    for it in range(20):
        lake.append_trajectories(synthetic_rows("r", it, 8))
    from buffer import delta

    dt = lake._table("trajectories")
    ds = delta.to_dataset(dt, [("run_id", "=", "r"), ("kind", "=", "train"), ("weight_version", ">=", 17)])
    assert len(list(ds.get_fragments())) == 3
    assert len(list(delta.to_dataset(dt, [("weight_version", "in", [3, 5])]).get_fragments())) == 3
    assert len(list(delta.to_dataset(dt, [("run_id", "=", "x")]).get_fragments())) == 0
    assert len(list(delta.to_dataset(dt, [("kind", "=", "eval")]).get_fragments())) == 0
    assert lake.training_slice("r", 17).num_rows == 24
    assert lake.training_slice("other-run", 0).num_rows == 0


def test_slice_after_an_outside_update_and_merge(tmp_path):
    """A table that deltalake's own UPDATE and MERGE rewrote (their files hold ``string_view``
    columns) still gives the right slices and recorded samples once some are consumed."""
    from deltalake import DeltaTable

    from buffer.schema import columns

    lake = Lake(str(tmp_path))
    lake.append_trajectories(synthetic_rows("r", 0, 8, weight_version=0))
    uri = lake.table_uri("trajectories")
    DeltaTable(uri).update(predicate="sample_index = 0", updates={"reward": "0.5"})
    source = lake.read("trajectories").slice(0, 2)
    DeltaTable(uri).merge(source, predicate="t.sample_uid = s.sample_uid", source_alias="s",
                          target_alias="t").when_matched_update_all().execute()
    uids = sorted(lake.read("trajectories").column("sample_uid").to_pylist())
    step = {c.name: None for c in columns("train_steps")}
    step.update(run_id="r", step=0, weight_version=1, sample_uids=uids[:3])
    lake.append_train_step(step)
    fresh = Lake(str(tmp_path))
    assert sorted(fresh.training_slice("r", 0).column("sample_uid").to_pylist()) == uids[3:]
    assert fresh.read_samples("r", uids[:3][::-1]).column("sample_uid").to_pylist() == uids[:3][::-1]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    parts=st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["train", "filtered", "partial"]),
                             st.integers(1, 5)), min_size=1, max_size=4),
    lo=st.integers(0, 5), span=st.one_of(st.none(), st.integers(0, 3)), seed=st.randoms(use_true_random=False),
)
def test_a_slice_of_written_rows_is_the_lake_slice_after_their_append(parts, lo, span, seed):
    """``slice_of_written`` (a sync iteration's slice built from the rows it is appending) is
    the very table ``training_slice`` reads back once they landed, when every older train row of
    the run in range is consumed: same rows, order, values and schema."""
    from buffer.lake import slice_of_written
    from buffer.schema import rows_to_table

    with tempfile.TemporaryDirectory() as tmp:
        lake = Lake(tmp)
        older = synthetic_rows("r", 0, 6, weight_version=lo)
        lake.append_trajectories(older)  # an earlier iteration's rows, consumed
        lake.append_train_step({"run_id": "r", "step": 0, "base_version": lo, "weight_version": lo + 1,
                                "sample_uids": [r["sample_uid"] for r in older]})
        rows, index = [], 0
        for version, kind, n in parts:  # one iteration's rows: kinds and versions mixed
            for row in synthetic_rows("r", 1, n, weight_version=version, kind=kind):
                rows.append({**row, "sample_uid": f"r/1/{index}", "sample_index": index})
                index += 1
        seed.shuffle(rows)
        table = rows_to_table("trajectories", rows)
        version = lake.append_trajectories(table)
        hi = None if span is None else lo + span
        read = lake.training_slice("r", lo, hi)
        built = slice_of_written(table, lo, hi, lake_version=version)
        assert built.equals(read, check_metadata=True)
        assert built.num_rows == sum(r["kind"] == "train" and r["weight_version"] >= lo
                                     and (hi is None or r["weight_version"] <= hi) for r in rows)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    parts=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["train", "filtered", "partial"]),
                             st.integers(1, 4)), min_size=1, max_size=4).filter(
        lambda ps: any(kind == "train" for _, kind, _ in ps)),
    k=st.integers(0, 2), ahead=st.integers(0, 3), seed=st.randoms(use_true_random=False),
)
def test_an_async_batch_slice_from_the_rows_sent_is_the_lake_read(parts, k, ahead, seed):
    """Async mode trains batch b on the rows its rollout side sent (``batch_slice``) while they
    commit: the same table ``read_rollout_batch`` reads once they landed, with older batches
    consumed and later ones already appended (the rollout side runs ahead); a train row outside
    the staleness bound is refused, not left behind."""
    from types import SimpleNamespace

    import pytest

    from buffer.schema import rows_to_table
    from tasks.async_batches import batch_slice, read_rollout_batch

    v = 5  # the trainer's version at batch 1; rows within the bound are at v - k .. v
    with tempfile.TemporaryDirectory() as tmp:
        lake = Lake(tmp)
        older = synthetic_rows("r", 0, 6, weight_version=v - k)
        lake.append_trajectories(older)  # batch 0, consumed by iteration 0
        lake.append_train_step({"run_id": "r", "step": 0, "base_version": v - k,
                                "weight_version": v - k + 1, "sample_uids": [r["sample_uid"] for r in older]})
        rows, index = [], 0
        for lag, kind, n in parts:  # batch 1: kinds and versions mixed, within the bound
            for row in synthetic_rows("r", 1, n, weight_version=v - min(lag, k), kind=kind):
                rows.append({**row, "sample_uid": f"r/1/{index}", "sample_index": index})
                index += 1
        seed.shuffle(rows)
        sent = rows_to_table("trajectories", rows)
        commit = lake.append_trajectories(sent)
        for later in range(2, 2 + ahead):
            lake.append_trajectories(synthetic_rows("r", later, 3, weight_version=v))
        rt = SimpleNamespace(lake=lake, run_id="r", cfg=SimpleNamespace(trainer=SimpleNamespace(max_staleness=k)))
        read, read_version = read_rollout_batch.fn(rt, v, 1)
        built = batch_slice(sent, v, k, 1, "r")
        assert built.equals(read, check_metadata=False)
        assert built.schema.equals(read.schema, check_metadata=False)
        assert read_version == commit + ahead
        stale = rows_to_table("trajectories", [{**rows[0], "kind": "train", "weight_version": v - k - 1}])
        with pytest.raises(RuntimeError, match="max_staleness"):
            batch_slice(pa.concat_tables([sent, stale]), v, k, 1, "r")
        lake.append_trajectories([{**stale.to_pylist()[0], "sample_uid": f"r/1/{index}", "sample_index": index}])
        with pytest.raises(RuntimeError, match="1 of them are older"):  # the lake read too
            read_rollout_batch.fn(rt, v, 1)


def test_an_async_batch_read_refuses_an_older_unconsumed_batch(tmp_path):
    """Iteration b trains on batch b only while every older batch is consumed: an unconsumed
    batch 0 when iteration 1 reads would be left behind for good (mutation review,
    2026-11-29: the refusal could be removed without a test failing)."""
    from types import SimpleNamespace

    import pytest

    from tasks.async_batches import read_rollout_batch

    lake = Lake(str(tmp_path))
    lake.append_trajectories(synthetic_rows("r", 0, 4, weight_version=1))  # never trained on
    lake.append_trajectories(synthetic_rows("r", 1, 4, weight_version=1))
    rt = SimpleNamespace(lake=lake, run_id="r", cfg=SimpleNamespace(trainer=SimpleNamespace(max_staleness=1)))
    with pytest.raises(RuntimeError, match=r"expects rollout batch 1 .* unconsumed batches found: \[0, 1\]"):
        read_rollout_batch.fn(rt, 1, 1)
    read, _ = read_rollout_batch.fn(rt, 1, 0)  # the oldest is what iteration 0 reads
    assert set(read.column("iteration").to_pylist()) == {0} and read.num_rows == 4
