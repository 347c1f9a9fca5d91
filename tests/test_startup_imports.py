"""What a run's start-up leaves out: the tiny model is built once per machine and configuration,
then copied (``infra.modeling.tiny_model``: same bytes as a fresh build, no transformers import);
``deterministic: true`` sets torch's flag without importing torch._inductor; and at the end, the
CLI's process skips Python's teardown (``infra.quick_exit``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from infra.config import TinyModelConfig
from infra.modeling import TINY_MODEL_FILES, build_tiny_model, tiny_model, tiny_model_key

ROOT = Path(__file__).resolve().parents[1]
TINY = TinyModelConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=64)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_cached_copy_holds_a_fresh_builds_bytes_and_skips_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("RLAKE_CACHE_DIR", str(tmp_path / "cache"))
    first = tiny_model(tmp_path / "run1" / "base_model", TINY, seed=3)
    fresh = build_tiny_model(tmp_path / "fresh", TINY, seed=3)
    assert _files(first) == _files(fresh)
    assert set(TINY_MODEL_FILES) <= set(_files(first))
    cached = tmp_path / "cache" / "tiny-models" / tiny_model_key(TINY, 3)
    assert _files(cached) == _files(fresh)
    # a second process: copied from the cache, transformers never imported
    code = ("import sys, json; from pathlib import Path; from infra.config import TinyModelConfig; "
            "from infra.modeling import tiny_model; "
            "tiny_model(Path(sys.argv[1]), TinyModelConfig(**json.loads(sys.argv[2])), seed=3); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run2" / "base_model"),
                          json.dumps(TINY.model_dump())], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "RLAKE_CACHE_DIR": str(tmp_path / "cache")}, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
    assert _files(tmp_path / "run2" / "base_model") == _files(fresh)


def test_another_seed_or_shape_is_another_model(tmp_path, monkeypatch):
    monkeypatch.setenv("RLAKE_CACHE_DIR", str(tmp_path / "cache"))
    a = tiny_model(tmp_path / "a", TINY, seed=0)
    b = tiny_model(tmp_path / "b", TINY, seed=1)
    wider = TINY.model_copy(update={"intermediate_size": 128})
    c = tiny_model(tmp_path / "c", wider, seed=0)
    weights = {(p / "model.safetensors").read_bytes() for p in (a, b, c)}
    assert len(weights) == 3
    assert len(list((tmp_path / "cache" / "tiny-models").iterdir())) == 4  # 3 models + the lock


def test_a_complete_folder_is_kept_and_an_incomplete_one_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("RLAKE_CACHE_DIR", str(tmp_path / "cache"))
    out = tiny_model(tmp_path / "base_model", TINY, seed=0)
    marker = out / "kept.txt"
    marker.write_text("a resumed run's folder is used as it is")
    assert tiny_model(out, TINY, seed=0) == out and marker.exists()
    (out / "model.safetensors").unlink()  # what a crash in the middle of writing it leaves
    tiny_model(out, TINY, seed=0)
    assert not marker.exists()
    assert _files(out) == _files(tmp_path / "cache" / "tiny-models" / tiny_model_key(TINY, 0))


def test_deterministic_algorithms_without_inductor():
    code = ("import sys, torch; from infra.modeling import use_deterministic_algorithms; "
            "assert not torch.are_deterministic_algorithms_enabled(); use_deterministic_algorithms(); "
            "print(torch.are_deterministic_algorithms_enabled(), 'torch._inductor' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False"]


def test_the_cli_ends_after_every_exit_handler_with_its_exit_code(tmp_path):
    """``infra.quick_exit``: a command's process skips Python's teardown, but only after every
    other exit handler ran and the output was flushed; with its own exit code."""
    marker = tmp_path / "handler-ran"
    code = ("import atexit, sys; import infra.cli as cli; "
            f"atexit.register(lambda: open({str(marker)!r}, 'w').write('ran')); "
            "print('before the command', flush=False); sys.argv = ['rlake', 'no-such-command']; cli.main()")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, out.stderr[-2000:]  # a usage error
    assert out.stdout.startswith("before the command") and "No such command" in out.stdout + out.stderr
    assert marker.read_text() == "ran"
    # imported without main (a test, a script): the process ends as Python ends it
    plain = subprocess.run([sys.executable, "-c", "import sys, infra.cli; print('x'); sys.exit(3)"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert (plain.returncode, plain.stdout) == (3, "x\n")


def test_setting_the_environment_after_prefect_was_imported_is_reported(tmp_path):
    """Prefect reads its settings when imported: rlake's (its batched server writers, no CSRF
    token fetch, quiet logs) set afterwards do nothing, so ``set_environment`` says so (a bench
    ran with Prefect's defaults this way, unnoticed); set first, it says nothing."""
    def stderr_of(first_import: str) -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        code = f"{first_import}; from infra.env import set_environment; set_environment({str(tmp_path)!r})"
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    late = stderr_of("import prefect.settings")
    assert "Prefect was imported before rlake's environment" in late and "PREFECT_CLIENT_CSRF" in late
    assert "Prefect was imported" not in stderr_of("import json")
