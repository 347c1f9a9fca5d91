"""SGLang engine pieces that need no server: payloads, response parsing, buckets, config,
and the pure-torch sgl_kernel stand-in installed into .venv-sglang."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import torch

from infra.ports import free_port
from rollout.engine import SamplingParams
from rollout.sglang.client import (
    SGLangError,
    generate_payload,
    parse_generate,
    parse_generate_batch,
    sampling_payload,
)
from rollout.sglang.config import SGLangConfig, section
from rollout.sglang.server import SHM, ManagedProcess, ServerSpec, SGLangServer, group_members, wait_ready
from rollout.sglang.weight_sync import buckets

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


def _standin():
    spec = importlib.util.spec_from_file_location("sgl_kernel_standin", ROOT / "scripts/sglang_cpu/sgl_kernel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sampling_payload_maps_names():
    sp = SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=4, stop_token_ids=(1, 2), seed=3)
    assert sampling_payload(sp) == {
        "max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 4,
        "stop_token_ids": [1, 2], "sampling_seed": 3,
    }
    assert "stop_token_ids" not in sampling_payload(SamplingParams(max_new_tokens=1))
    body = generate_payload([5, 6], SamplingParams(max_new_tokens=2), "r1")
    assert body["input_ids"] == [5, 6] and body["return_logprob"] is True and body["rid"] == "r1"


def test_batched_payload_and_results():
    body = generate_payload([[5, 6], [7]], SamplingParams(max_new_tokens=2), ["r1", "r2"])
    assert body["input_ids"] == [[5, 6], [7]] and body["rid"] == ["r1", "r2"]
    with pytest.raises(ValueError, match="2 prompts need as many request ids"):
        generate_payload([[5, 6], [7]], SamplingParams(max_new_tokens=2), "r1")
    one = {"meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-1.0, 7, None]]}}
    assert [r.token_ids for r in parse_generate_batch([one, one], 2)] == [[7], [7]]
    with pytest.raises(SGLangError, match="1 results for 2 prompts"):
        parse_generate_batch([one], 2)


@pytest.mark.parametrize(("n", "size", "workers", "expected"), [
    (8, 8, 2, [4, 4]),          # every worker gets a call
    (20, 8, 1, [8, 8, 4]),      # consecutive, the last shorter
    (3, 8, 4, [1, 1, 1]),       # fewer prompts than workers: one each
    (5, 1, 1, [1] * 5),         # one call per prompt (slime's way)
    (0, 8, 2, []),
])
def test_request_chunks_cut_consecutive_calls(n, size, workers, expected):
    from rollout.sglang.batch import request_chunks

    chunks = request_chunks(n, size, workers)
    assert [len(c) for c in chunks] == expected
    assert [i for c in chunks for i in c] == list(range(n))


def test_parse_generate_maps_logprobs_and_finish_reason():
    resp = {
        "output_ids": [7, 1],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 1},
            "output_token_logprobs": [[-2.5, 7, None], [-0.25, 1, None]],
            "weight_version": "3", "prompt_tokens": 5,
        },
    }
    r = parse_generate(resp)
    assert r.token_ids == [7, 1] and r.logprobs == [-2.5, -0.25] and r.finish_reason == "stop"
    assert r.meta["weight_version"] == "3"
    resp["meta_info"]["finish_reason"] = {"type": "length", "length": 2}
    assert parse_generate(resp).finish_reason == "length"
    resp["meta_info"]["finish_reason"] = {"type": "abort", "message": "x"}
    assert parse_generate(resp).finish_reason == "abort"
    resp["output_ids"] = [7, 2]
    with pytest.raises(SGLangError, match="disagree"):
        parse_generate(resp)


def test_buckets_keep_order_and_bound_size():
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5])]  # 4-byte floats
    got = [[name for name, _ in b] for b in buckets(named, bucket_bytes=80)]
    assert got == [["t0", "t1"], ["t2"], ["t3", "t4"]]


def test_config_from_mapping_and_sections():
    assert section({"rollout": {"engine": "sglang", "sglang": {"num_servers": 2}}}) == {"num_servers": 2}
    assert SGLangConfig.from_mapping({"num_servers": 2, "router": True}).num_servers == 2
    with pytest.raises(ValueError, match="unknown key"):
        SGLangConfig.from_mapping({"num_server": 2})
    with pytest.raises(ValueError, match="weight_sync"):
        SGLangConfig(weight_sync="nfs")


def test_server_command_has_cpu_flags(tmp_path):
    fake_python = tmp_path / "python"
    fake_python.write_text("")
    cmd = ServerSpec(model_path="/m", port=1234, python=str(fake_python), weight_version="7").command()
    assert cmd[:3] == [str(fake_python), "-m", "sglang.launch_server"]
    for flag in ("--device", "cpu", "--dtype", "float32", "--sleep-on-idle", "--skip-server-warmup"):
        assert flag in cmd
    assert cmd[cmd.index("--weight-version") + 1] == "7"
    with pytest.raises(FileNotFoundError, match="setup_sglang.sh"):
        ServerSpec(model_path="/m", port=1, python=str(tmp_path / "missing")).command()


def test_standin_assign_req_to_token_pool():
    k = _standin()
    table = torch.zeros(4, 10, dtype=torch.int32)
    locs = torch.arange(100, 107, dtype=torch.int64)
    k.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), table, torch.tensor([1, 5]), torch.tensor([4, 9]), locs, table.shape[1])
    assert table[2, 1:4].tolist() == [100, 101, 102]
    assert table[0, 5:9].tolist() == [103, 104, 105, 106]
    assert int(table.sum()) == sum(range(100, 107))


def test_standin_copy_all_layer_kv_cache_moves_slots_in_every_buffer():
    k = _standin()
    bufs = [torch.arange(40, dtype=torch.float32).reshape(10, 4) + 1000 * i for i in range(3)]
    ref = [b.clone() for b in bufs]
    src, tgt = torch.tensor([1, 2, 3]), torch.tensor([2, 3, 7])  # overlapping move
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs], dtype=torch.int64)
    k.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, r in zip(bufs, ref, strict=True):
        r[tgt] = r[src].clone()
        assert torch.equal(b, r)
    with pytest.raises(NotImplementedError, match="no CPU stand-in"):
        k.some_cuda_only_kernel()


# what an SGLang server's processes leave behind, small: a named semaphore (spawn context), a
# shared-memory segment named like its scheduler's, a file in its temporary folder
LEAVES_BEHIND = """
import multiprocessing, os, sys, tempfile, time
from multiprocessing import shared_memory
lock = multiprocessing.get_context("spawn").Lock()
segment = shared_memory.SharedMemory(name=f"sglang_rlake_test_{os.getpid()}", create=True, size=64)
open(os.path.join(tempfile.gettempdir(), "made-here"), "w").close()
print(segment.name, lock._semlock.name.lstrip("/"), tempfile.gettempdir(), flush=True)
time.sleep(600)
"""


# a semaphore left by a process that is not the stopped one's: made, then its maker killed with
# its resource tracker before it unlinked it
FOREIGN_ORPHAN = """
import multiprocessing, os, signal
lock = multiprocessing.get_context("spawn").Lock()
print(lock._semlock.name.lstrip("/"), flush=True)
os.killpg(0, signal.SIGKILL)
"""


def foreign_orphan_semaphore() -> str:
    out = subprocess.run([sys.executable, "-c", FOREIGN_ORPHAN], capture_output=True, text=True,
                         start_new_session=True, timeout=120)
    name = f"sem.{out.stdout.split()[0]}"
    assert (SHM / name).exists(), out.stderr
    return name


@pytest.mark.parametrize("dead_before_stop", [False, True], ids=["stopped", "died"])
def test_a_stopped_process_leaves_nothing_in_tmp_or_dev_shm(tmp_path, dead_before_stop):
    """A launch's temporary folder is its own and goes with it; the semaphore and shared memory
    its processes left in /dev/shm (killed with their resource tracker, as SGLang kills its own)
    are removed at its stop, whether it was alive then or had died while starting (noted by
    ``wait_ready``). What other processes made meanwhile stays: a segment and a
    semaphore this process holds (a semaphore's maker maps it under another name: it looked
    unused, and was removed, before 2026-11-28), and another process's orphaned semaphore."""
    log = tmp_path / "child.log"
    proc = ManagedProcess([sys.executable, "-c", LEAVES_BEHIND], dict(os.environ), str(log), "leaver")
    proc.start()
    held_lock = multiprocessing.get_context("spawn").Lock()  # made meanwhile, never opened by name
    held_semaphore = f"sem.{held_lock._semlock.name.lstrip('/')}"
    foreign = foreign_orphan_semaphore()
    try:
        deadline = time.monotonic() + 120
        while not log.read_text().strip():
            assert proc.alive() and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        segment, semaphore, tmp = log.read_text().split()
        assert tmp == proc.tmp_dir and (Path(tmp) / "made-here").exists()
        held = shared_memory.SharedMemory(name=f"sglang_rlake_test_held_{os.getpid()}", create=True,
                                          size=64)
        if dead_before_stop:  # it dies while starting: noted by the wait for it, not at its stop
            with pytest.raises(TimeoutError):
                wait_ready(proc, f"http://127.0.0.1:{free_port()}", timeout_s=1.0)
            os.killpg(proc.pid, signal.SIGKILL)  # the group: the resource tracker too
            proc.proc.wait(timeout=30)
            assert (SHM / segment).exists() and (SHM / f"sem.{semaphore}").exists()
    finally:
        proc.stop()
    try:
        assert not (SHM / segment).exists() and not (SHM / f"sem.{semaphore}").exists()
        assert not Path(tmp).exists()
        assert (SHM / held.name).exists() and (SHM / held_semaphore).exists() and (SHM / foreign).exists()
    finally:
        held.close()
        held.unlink()
        (SHM / foreign).unlink()


# a leader that records a SIGTERM and a child in its group that outlives it unless killed
TERM_RECORDER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: print("TERM", flush=True))
child = os.fork()
if child == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
    os._exit(0)
print("child", child, flush=True)
time.sleep(600)
"""


def test_a_server_is_killed_at_once_and_none_of_its_group_outlives_the_stop(tmp_path):
    """An SGLang server is not sent SIGTERM (it then sleeps 5 s before killing its own tree):
    ``stop`` SIGKILLs its group and returns once every process of it is gone."""
    log = tmp_path / "server.log"
    server = SGLangServer(ServerSpec(model_path=str(tmp_path), port=free_port(), log_path=str(log)))
    server.cmd = [sys.executable, "-c", TERM_RECORDER]  # the real class's stop, on a small child
    server.start()
    try:
        deadline = time.monotonic() + 120
        while "child" not in log.read_text():
            assert server.alive() and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        child = int(log.read_text().split()[1])
        assert sorted(group_members(server.pid)) == sorted([server.pid, child])
        assert not server.wait_group_gone(0.1)  # what stop waits for, after its SIGKILL
    finally:
        server.stop()
    assert "TERM" not in log.read_text()
    assert group_members(server.pid) == []  # the child too (at most a zombie, if not reaped yet)


OWNS_A_SERVER = """
import os, sys, time
from rollout.sglang.server import ManagedProcess
proc = ManagedProcess([sys.executable, "-c", "import time; time.sleep(300)"], dict(os.environ),
                      None, "sleeper")
proc.start()
print(proc.pid, flush=True)
time.sleep(300)
"""


def test_a_launched_server_dies_with_the_process_that_launched_it(tmp_path):
    """In a session of its own, an SGLang server outlived a kill -9 of its run (seen: a server
    left running by a killed test), holding its port and, on a GPU, its memory while the resumed
    run started new ones."""
    from tests.opshelp import ROOT

    owner = subprocess.Popen([sys.executable, "-c", OWNS_A_SERVER], cwd=ROOT, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        server = int(owner.stdout.readline())
        deadline = time.monotonic() + 60
        while "time.sleep(300)" not in Path(f"/proc/{server}/cmdline").read_bytes().decode(errors="replace"):
            assert time.monotonic() < deadline, "the server never started"
            time.sleep(0.05)  # until it has exec'd (its parent-death signal is set before)
        assert os.getpgid(server) == server  # still a session of its own
        owner.kill()
        owner.wait(30)
        deadline = time.monotonic() + 10
        while running(server):
            assert time.monotonic() < deadline, "the server outlived its owner"
            time.sleep(0.05)
    finally:
        owner.kill()


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
