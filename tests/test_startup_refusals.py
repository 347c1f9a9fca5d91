"""Start-up refusals that must leave a usable run id, the validated ``rollout.sglang`` section,
the SGLang server following the top-level ``device``, and ``rlake serve`` stopped by Ctrl-C
(review, 2026-11-29). The real CLI in a subprocess where it is cheap, real config loading."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from buffer import Lake
from infra.config import ConfigError, config_from_dict, load_config
from infra.startup import StartupError, refuse_existing
from rollout.sglang.engine import config_for_run, server_spec
from tests.opshelp import ROOT, cli_env, rlake, tail

QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
# a hang guard per wait (fails with the log), not a speed expectation
HANG_GUARD_S = 300


def error_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("error:")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_refused_before_the_run_is_recorded(tmp_path):
    home = tmp_path / "home"
    log = tmp_path / "run.log"
    done = rlake(["run", QUICKSTART, "--run-id", "dev1", "--set", "device=cuda",
                  "--set", f"home={home}"], cli_env(None), log, timeout=HANG_GUARD_S)
    assert done.returncode == 1, tail(log)
    lines = error_lines(log)
    assert len(lines) == 1 and "Traceback" not in log.read_text(), tail(log)
    assert lines[0].startswith("error: bad config value for 'device': cuda was requested"), lines
    assert "cpu or auto" in lines[0]  # what is allowed
    # nothing recorded: the id is free for the run once mended
    assert not (home / "runs" / "dev1").exists()
    assert Lake(str(home / "lake")).get_run("dev1") is None


def test_run_failed_after_its_record_is_started_again_under_its_id(tmp_path):
    """A prompt longer than the model takes is found after the run's row is written (the
    tokenizer is the model's): the message says how to start it again, and the same id is
    taken by a new run once the file is mended, while a run that wrote anything keeps it."""
    home, prompts = tmp_path / "home", tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+2=", "label": "3"}) + "\n"
                       + json.dumps({"prompt": "1+" * 60 + "2=", "label": "3"}) + "\n")
    overrides = ["--set", f"home={home}", "--set", f"data.prompt_data={prompts}",
                 "--set", "sft.enabled=false", "--set", "num_rollout=1"]
    log = tmp_path / "run.log"
    done = rlake(["run", QUICKSTART, "--run-id", "p1", *overrides], cli_env(None), log,
                 timeout=HANG_GUARD_S)
    assert done.returncode == 1, tail(log)
    (line,) = error_lines(log)
    assert f"{prompts}:line 2: prompt has" in line, line
    assert f"`rlake run CONFIG --run-id p1 --home {home}` starts it again" in line, line
    assert "rlake resume" not in line, line  # resume re-reads the recorded (bad) data
    cfg = load_config(QUICKSTART, [o for o in overrides if o != "--set"])
    lake = Lake(cfg.resolved_lake_uri)
    assert lake.get_run("p1")["status"] == "failed"
    refuse_existing(lake, cfg, "p1")  # not refused: it wrote nothing but its row

    # once it wrote something (a checkpoint folder here), the id names that run for good
    (home / "runs" / "p1" / "checkpoints" / "v000000").mkdir(parents=True)
    with pytest.raises(StartupError, match="run 'p1' already exists"):
        refuse_existing(lake, cfg, "p1")


@pytest.mark.parametrize(("override", "key"), [
    ("rollout.sglang.health_interval_s=.inf", "health_interval_s"),
    ("rollout.sglang.health_timeout_s=.nan", "health_timeout_s"),
    ("rollout.sglang.max_total_tokens=abc", "max_total_tokens"),
    ("rollout.sglang.bucket_mb=-5", "bucket_mb"),
    ("rollout.sglang.num_servers=2.5", "num_servers"),
    ("rollout.sglang.concurrency=abc", "concurrency"),
    ("rollout.sglang.weight_sync=nfs", "weight_sync"),
    ("rollout.sglang.router=3", "router"),
])
def test_sglang_section_refuses_bad_values_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, [override])
    assert str(err.value).startswith(f"bad config value for 'rollout.sglang.{key}': "), err.value


def test_sglang_section_refuses_an_unknown_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.sglang.num_server' "
                                          r"\(did you mean 'rollout.sglang.num_servers'\?\)"):
        load_config(QUICKSTART, ["rollout.sglang.num_server=2"])


def test_sglang_bad_value_from_the_cli_is_one_line_naming_the_key(tmp_path):
    log = tmp_path / "run.log"
    done = rlake(["run", QUICKSTART, "--set", "rollout.sglang.concurrency=abc",
                  "--set", f"home={tmp_path / 'home'}"], cli_env(None), log, timeout=HANG_GUARD_S)
    assert done.returncode != 0
    (line,) = error_lines(log)
    assert line.startswith("error: bad config value for 'rollout.sglang.concurrency': "), line


def _server_args(overrides: list[str], cuda_available: bool) -> list[str]:
    """The SGLang server's command line for a run config (nothing started); the config goes
    through its recorded form too, as a resume reads it."""
    cfg = load_config(QUICKSTART, [f"rollout.sglang.python={sys.executable}", *overrides])
    recorded = config_from_dict(json.loads(cfg.model_dump_json()))
    commands = [server_spec(config_for_run(c, cuda_available=cuda_available), "/model", 30000, 0)
                .command() for c in (cfg, recorded)]
    assert commands[0] == commands[1]
    return commands[0]


def test_sglang_server_follows_the_top_level_device():
    on_gpu = _server_args(["device=cuda"], cuda_available=True)
    assert "--device" not in on_gpu and "--max-total-tokens" not in on_gpu, on_gpu
    for overrides, cuda in ((["device=cpu"], True), (["device=auto"], False),
                            (["device=cuda", "rollout.sglang.device=cpu"], True)):
        args = _server_args(overrides, cuda_available=cuda)
        assert args[args.index("--device") + 1] == "cpu", (overrides, args)
        assert args[args.index("--max-total-tokens") + 1] == "65536", (overrides, args)
    explicit = _server_args(["device=cuda", "rollout.sglang.max_total_tokens=4096"], True)
    assert explicit[explicit.index("--max-total-tokens") + 1] == "4096"


def test_serve_stopped_by_ctrl_c_is_as_clean_as_sigterm(tmp_path):
    home = tmp_path / "home"
    deployed = rlake(["deploy", QUICKSTART, "--name", "nightly", "--cron", "0 2 * * *",
                      "--set", f"home={home}"], cli_env(None), tmp_path / "deploy.log")
    assert deployed.returncode == 0, tail(tmp_path / "deploy.log")
    log = tmp_path / "serve.log"
    # the runner's debug lines say when its poll loop runs: a Ctrl-C before that stopped
    # cleanly already, the review's came while the runner ran
    serve = rlake(["serve", "--home", str(home), "--maintenance-interval", "0"],
                  cli_env(None, PREFECT_HOME=str(home / "prefect"), PREFECT_LOGGING_LEVEL="DEBUG"),
                  log, background=True)
    try:
        guard = time.monotonic() + HANG_GUARD_S
        while "Discovered 0 scheduled flow runs" not in log.read_text():
            assert serve.poll() is None, f"serve exited ({serve.returncode}): {tail(log)}"
            assert time.monotonic() < guard, f"hang guard: serve never served: {tail(log)}"
            time.sleep(0.2)
        serve.send_signal(signal.SIGINT)
        code = serve.wait(timeout=HANG_GUARD_S)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    out = log.read_text()
    assert code in (0, 130), out
    assert "Traceback" not in out and "ERROR" not in out, out
    assert "Prefect server stopped" in out, out  # the server it started is stopped


def test_a_run_id_taken_in_a_shared_lake_names_the_owners_home_to_resume(tmp_path):
    """Two homes writing one lake: a new run under an id another home's run holds is told the
    resume that works, with the owner's home (it named the refused run's own home, where the
    resume found no checkpoint)."""
    shared = tmp_path / "shared-lake"
    owner = load_config(QUICKSTART, [f"home={tmp_path / 'hJ'}", f"lake_uri={shared}"])
    lake = Lake(str(shared))
    lake.upsert_run({"run_id": "rid", "status": "completed", "config": owner.model_dump_json(),
                     "mlflow_run_id": "m1"})
    newcomer = load_config(QUICKSTART, [f"home={tmp_path / 'hK'}", f"lake_uri={shared}"])
    with pytest.raises(StartupError, match="already exists") as refused:
        refuse_existing(lake, newcomer, "rid")
    assert f"`rlake resume rid --home {tmp_path / 'hJ'} --lake {shared}`" in str(refused.value)


def test_a_prompt_file_row_without_a_label_is_refused_at_start_for_a_labelled_reward(tmp_path):
    """``exact`` compares the response with the label: a row with a null label is named (file
    and line) before the run is recorded, not failed as a sample at every iteration; the same
    file under a reward that needs no label (``countdown``) starts without an SFT warm-up (which
    trains on labels: tests/test_user_models.py)."""
    from infra.startup import check_data

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+2=", "label": "3"}) + "\n"
                       + json.dumps({"prompt": "1+1=", "label": None}) + "\n")
    cfg = load_config(QUICKSTART, [f"data.prompt_data={prompts}", "rollout.rm_type=exact"])
    with pytest.raises(StartupError, match=rf"{prompts}:line 2: the label is null \(missing\), "
                                           r"but its reward 'exact'"):
        check_data(cfg)
    check_data(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"rm_type": "countdown"}),
                                      "sft": cfg.sft.model_copy(update={"enabled": False})}))


@pytest.mark.parametrize(("sets", "key"), [
    (["mode=async", "trainer.max_staleness=0"], "trainer.max_staleness"),
    (["rollout.num_engines=2"], "rollout.num_engines"),
    (["rollout.over_sampling_batch_size=1"], "rollout.over_sampling_batch_size"),
    (["trainer.use_kl_loss=true", "trainer.kl_coef=0.1"], "trainer.use_kl_loss"),
])
def test_a_check_across_keys_names_the_key_in_its_error(sets, key):
    """A check across keys (a section's or the whole config's) put '(config)' or the section's
    name where the key goes: ``bad config value for '(config)': mode 'async' needs ...``
    (review, 2026-11-29)."""
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, sets)
    assert str(err.value).startswith(f"bad config value for '{key}': "), str(err.value)


def test_resume_with_set_says_the_settings_are_the_records(tmp_path):
    """``rlake resume RUN --set k=v`` failed with the parser's "No such option: --set", which
    read as a typo; it now says why, before anything is opened (review, 2026-11-29)."""
    log = tmp_path / "resume.log"
    proc = rlake(["resume", "r1", "--home", str(tmp_path / "home"), "--set", "mode=sync"],
                 cli_env(None), log)
    assert proc.returncode == 1, tail(log)
    assert error_lines(log) and error_lines(log)[0].startswith(
        "error: --set mode=sync: a run's settings are fixed at its record"), tail(log)


def test_resume_with_set_refuses_before_it_reads_anything(tmp_path, monkeypatch):
    """The refusal comes first: no config loaded, no lake opened."""
    import infra.cli
    import infra.startup

    called = []
    monkeypatch.setattr(infra.cli, "load_config", lambda *a, **k: called.append("config"))
    monkeypatch.setattr(infra.startup, "open_lake", lambda *a, **k: called.append("lake"))
    with pytest.raises(ValueError, match="a run's settings are fixed at its record"):
        infra.cli.resume("r1", home=str(tmp_path), lake_uri=None, num_rollout=None,
                         set_=["mode=sync"])
    assert called == []
