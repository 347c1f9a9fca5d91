"""``rlake ui prefect|mlflow``: a run's Prefect or MLflow UI, offline, on 127.0.0.1.

The UI server runs as a child process in its own session (a Ctrl-C here stops it, and nothing
of it outlives the command: a SIGTERM or SIGHUP stops it as a Ctrl-C does, and a SIGKILL of
this process has the kernel SIGTERM the server) with every telemetry/analytics switch of
``infra.env.OFFLINE_ENV`` set. The MLflow experiment is tagged ``mlflow.experimentKind = custom_model_development`` and the
printed address carries ``workflowType=machine_learning``: MLflow 3 otherwise opens an
experiment on its (empty, for rlake) GenAI overview instead of the runs and their metric charts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from infra.env import OFFLINE_ENV
from infra.prefect_server import _die_with_parent

UIS = ("prefect", "mlflow")
DEFAULT_PORTS = {"prefect": 4200, "mlflow": 5000}
HEALTH = {"prefect": "/api/health", "mlflow": "/health"}
START_TIMEOUT_S = 180.0  # Prefect's first start migrates its database; slow on a loaded machine
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


def ui_env(which: str, home: Path) -> dict[str, str]:
    """The UI server's environment: offline, analytics off, state under ``home``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env.update(OFFLINE_ENV)
    env.update({"PREFECT_SERVER_LOGGING_LEVEL": "WARNING", "MLFLOW_LOGGING_LEVEL": "WARNING"})  # to its log
    if which == "prefect":
        env.update({"PREFECT_HOME": str(home / "prefect"), "PREFECT_UI_ENABLED": "true",
                    "PREFECT_SERVER_UI_ENABLED": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "PREFECT_SERVER_API_HOST": "127.0.0.1"})
    return env


def ui_command_line(which: str, home: Path, port: int) -> list[str]:
    if which == "prefect":
        return [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                "--port", str(port), "--analytics-off", "--no-scheduler", "--no-late-runs"]
    from infra.tracking import tracking_uri

    return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking_uri(home),
            "--default-artifact-root", (home / "mlflow" / "artifacts").as_uri(),
            "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 - 127.0.0.1 only
            return resp.status == 200
    except OSError:
        return False


def mlflow_landing(home: Path, base: str) -> str:
    """Tag the rlake experiment as machine learning (idempotent) and return its runs page."""
    from mlflow.tracking import MlflowClient

    from infra.tracking import EXPERIMENT, relocate_artifacts, tracking_uri

    relocate_artifacts(home)  # a moved home: its artifacts are served from where they are now
    client = MlflowClient(tracking_uri=tracking_uri(home))
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        return base
    for key, value in EXPERIMENT_KIND.items():
        client.set_experiment_tag(exp.experiment_id, key, value)
    return f"{base}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning"


def stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def raise_interrupt(signum: int, frame: object) -> None:  # noqa: ARG001 - signal handler signature
    """A signal handler: the signal is a Ctrl-C (``rlake ui``'s and ``rlake serve``'s stop)."""
    raise KeyboardInterrupt


def stop_on_signals() -> dict[int, object]:
    """SIGTERM and SIGHUP (``kill``, a closed terminal) raise KeyboardInterrupt, as a Ctrl-C: the
    ``finally`` that stops the server runs. Before, they ended this process at once and left the
    server, in its own session, running (review, 2026-11-29). Returns the handlers replaced."""
    old = {}
    try:
        for sig in STOP_SIGNALS:
            old[sig] = signal.signal(sig, raise_interrupt)
    except ValueError:  # not the main thread: signals cannot be set (the parent-death signal stays)
        pass
    return old


def restore_signals(old: dict[int, object]) -> None:
    for sig, handler in old.items():
        signal.signal(sig, handler)


def ui_command(
    which: Annotated[str, typer.Argument(help="prefect | mlflow")],
    home: Annotated[str, typer.Option("--home", help="state folder of the runs")] = "./rlake-home",
    port: Annotated[int | None, typer.Option("--port", min=1, max=65535,
                                             help="default: 4200 (Prefect), 5000 (MLflow)")] = None,
) -> None:
    """Open a run's Prefect or MLflow UI on 127.0.0.1, offline (Ctrl-C stops it)."""
    console = Console()
    if which not in UIS:
        raise typer.BadParameter(f"{which!r}: choose one of {', '.join(UIS)}", param_hint="WHICH")
    root = Path(home).resolve()
    state = root / ("prefect" if which == "prefect" else "mlflow")
    if not state.is_dir():
        raise ValueError(f"no {which} state under --home {home} ({state} does not exist): "
                         "give the --home of a run")
    port = port or DEFAULT_PORTS[which]
    base = f"http://127.0.0.1:{port}"
    if answers(base + HEALTH[which]):
        raise ValueError(f"something already answers on {base}: pick another --port")
    for key, value in OFFLINE_ENV.items():  # before MLflow is imported here
        os.environ.setdefault(key, value)
    landing = mlflow_landing(root, base) if which == "mlflow" else base
    log = state / f"ui-{which}.log"
    old = stop_on_signals()
    try:
        with open(log, "w") as out:  # the server dies with this process even if it is SIGKILLed
            proc = subprocess.Popen(ui_command_line(which, root, port), env=ui_env(which, root),
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=_die_with_parent)  # noqa: PLW1509
    except BaseException:
        restore_signals(old)
        raise
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not answers(base + HEALTH[which]):
            if proc.poll() is not None:
                raise RuntimeError(f"the {which} UI server exited ({proc.returncode}); see {log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {which} UI server did not answer in {START_TIMEOUT_S:.0f}s; "
                                   f"see {log}")
            time.sleep(0.5)
        console.print(f"{which} UI: {landing}   (offline, analytics off; Ctrl-C stops it)",
                      soft_wrap=True, highlight=False)
        proc.wait()
        raise RuntimeError(f"the {which} UI server exited ({proc.returncode}); see {log}")
    finally:
        restore_signals(old)  # a second SIGTERM while stopping: the parent-death signal covers it
        stop(proc)
