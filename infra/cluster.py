"""Ray for rlake: the no-probe guard, starting or joining a cluster, placement groups.

Ray is imported only here and in the modules that place actors (rollout/ray_engines.py,
trainers/ray_trainer.py), and only when ``cluster.ray_address`` is set: the embedded default
never imports it.

The guard. Ray's dashboard (its usage-stats module runs even with usage stats off) reads
``~/ray_bootstrap_config.yaml`` (``$HOME`` of the process starting the head) to learn the cloud
provider; when that file is missing it asks the cloud-metadata addresses (169.254.169.254,
metadata.google.internal) instead (``ray._common.usage.usage_lib.get_cluster_config_to_report``).
A file with ``provider: {type: local}`` answers the question, so nothing is asked. A cluster not
started by ``ray.init`` (``ray start``, ``ray.cluster_utils.Cluster``) also sends a "usage stats
disabled" note to usage-stats.ray.io; ``RAY_USAGE_STATS_REPORT_URL`` points that at 127.0.0.1.
Both must hold before any Ray process starts: ``prepare_ray`` does it, and every start goes
through it.

Joining a cluster (an address): ``connect`` first checks that something answers at HOST:PORT
(``probe_address``; Ray itself would retry for ~14 minutes), then asks the cluster whether it
wants a Ray auth token and runs the client in token-auth mode when it does (``client_auth_mode``):
``ray start --head`` turns token auth on by itself when a token file exists, ``ray.init(address)``
never does.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from infra.config import ClusterConfig, RunConfig, megatron_world_size
from infra.paths import write_text_atomic

BOOTSTRAP_NAME = "ray_bootstrap_config.yaml"
LOCAL_PROVIDER = {"provider": {"type": "local"}}
# environment every Ray process must inherit (set before Ray starts; a value the user set wins,
# except usage stats, which stay off)
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/",  # discard port: the note goes nowhere
}
NAMESPACE = "rlake"
PROBE_TIMEOUT_S = 10.0  # connect(): how long HOST:PORT may take to accept a TCP connection
AUTH_MODE_ENV = "RAY_AUTH_MODE"


def bootstrap_path() -> Path:
    """Where Ray's dashboard looks: ``os.path.expanduser('~/ray_bootstrap_config.yaml')``."""
    return Path(os.path.expanduser(f"~/{BOOTSTRAP_NAME}"))


def ensure_bootstrap_guard(path: Path | None = None) -> Path:
    """Make sure the bootstrap config exists and names a provider; write
    ``provider: {type: local}`` if it is missing. An existing file (a real autoscaler cluster's)
    is kept as it is, but one without ``provider.type`` is an error: Ray would probe then."""
    path = path or bootstrap_path()
    if path.exists():
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise RuntimeError(f"{path}: not valid YAML ({err}); Ray would probe cloud metadata") from None
        provider = data.get("provider") if isinstance(data, dict) else None
        if not isinstance(provider, dict) or not provider.get("type"):
            raise RuntimeError(f"{path} has no provider.type: Ray would probe cloud-metadata "
                               "addresses; add 'provider: {type: local}' to it")
        return path
    write_text_atomic(path, "# written by rlake (infra/cluster.py): tells Ray's dashboard the "
                      "provider, so\n# it never asks cloud-metadata addresses\n"
                      + yaml.safe_dump(LOCAL_PROVIDER))
    return path


def is_loopback(address: str | None) -> bool:
    """``local``, or an address whose host is 127.0.0.1 / localhost."""
    if address in (None, "local"):
        return True
    host = address.removeprefix("ray://").rsplit(":", 1)[0]
    return host in ("127.0.0.1", "localhost", "::1", "[::1]")


def prepare_ray(loopback: bool = True) -> Path:
    """The guard + the environment Ray processes inherit; call before anything starts Ray.

    ``loopback``: keep every Ray address on 127.0.0.1. Ray otherwise swaps 127.0.0.1 for the
    machine's interface address (``services.resolve_ip_for_localhost``) unless
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which Ray reads when it is first imported: so this
    must run before ``import ray``."""
    path = ensure_bootstrap_guard()
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    if loopback:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import sys

        constants = sys.modules.get("ray._private.ray_constants")
        if constants is not None and constants.ENABLE_RAY_CLUSTER:
            raise RuntimeError("ray was imported before infra.cluster.prepare_ray: it would use "
                               "the machine's address instead of 127.0.0.1")
    return path


@dataclass
class RayConnection:
    """This process's use of Ray: ``release`` shuts Ray down when the last user lets go and
    rlake was the one that called ``ray.init``."""

    address: str
    owns_init: bool
    users: list[str] = field(default_factory=list)

    def release(self, user: str) -> None:
        if user in self.users:
            self.users.remove(user)
        if not self.users and self.owns_init:
            import ray

            ray.shutdown()
            _CONNECTION.pop("current", None)


# Ray's driver state is per process (ray.init is global), so the connection is too.
_CONNECTION: dict[str, RayConnection] = {}


def megatron_ray_ranks(cfg: RunConfig) -> int:
    """The Megatron world when its ranks run as Ray actors, else 0: Ray on, backend megatron,
    world > 1 (a world of one stays one trainer, in process or in its actor)."""
    world = megatron_world_size(cfg.trainer)
    on = cfg.cluster.ray_address is not None and cfg.trainer.backend == "megatron" and world > 1
    return world if on else 0


def required_cpus(cfg: RunConfig) -> int:
    """Logical CPUs a local Ray must offer: ceil(num_engines x num_cpus_per_engine + the
    trainer's): the trainer actor's, or world x trainer_num_cpus for Megatron ranks as actors."""
    r, c = cfg.rollout, cfg.cluster
    ranks = megatron_ray_ranks(cfg)
    trainer = ranks * c.trainer_num_cpus if ranks else c.trainer_num_cpus if c.trainer_on_ray else 0
    return int(-(-(r.num_engines * r.num_cpus_per_engine + trainer) // 1))


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``ray://HOST:PORT`` (IPv6 as ``[::1]:PORT``) -> (host, port); a
    ``ValueError`` naming ``cluster.ray_address`` for anything else."""
    rest = address.strip().removeprefix("ray://").split("/", 1)[0]
    host, sep, port = rest.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"cluster.ray_address={address!r}: expected HOST:PORT or ray://HOST:PORT "
                         "(or 'local')")
    return host, int(port)


def host_port(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 host in brackets (``[::1]:PORT``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def probe_address(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise ``ConnectionError`` (one line, naming ``cluster.ray_address``) when nothing accepts
    a TCP connection at the address's HOST:PORT within ``timeout_s``. Ray's own join would retry
    for ~14 minutes (20 x ~41 s) before failing."""
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as err:
        reason = (f"no answer within {timeout_s:g} s" if isinstance(err, TimeoutError)
                  else err.strerror or str(err))
        raise ConnectionError(f"cluster.ray_address={address}: nothing answers at {host_port(host, port)} "
                              f"({reason}); start the cluster first (ray start "
                              "--head --port=PORT, docs/cluster.md) or fix the address") from None


def default_token_path() -> Path:
    """Where Ray looks for its auth token when neither RAY_AUTH_TOKEN nor RAY_AUTH_TOKEN_PATH is
    set: ``~/.ray/auth_token`` (``authentication_token_setup._get_default_token_path``)."""
    return Path.home() / ".ray" / "auth_token"


def cluster_wants_token(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
    """Ask the GCS at ``HOST:PORT`` (``GetClusterId``, sent without a token): True when it
    answers UNAUTHENTICATED (token auth on), False when it answers, None when it cannot tell
    (a ``ray://`` client-server address, no gRPC answer)."""
    if address.startswith("ray://"):
        return None
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:
        return None
    with grpc.insecure_channel(host_port(*split_address(address)), options=[("grpc.enable_http_proxy", 0)]) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
        except grpc.RpcError as err:
            return True if err.code() == grpc.StatusCode.UNAUTHENTICATED else None
    return False


def token_available() -> bool:
    """Whether Ray would find an auth token here: Ray's own loader when it can be asked
    (``AuthenticationTokenLoader.has_token(ignore_auth_mode=True)``: RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token), else the same three places by hand."""
    try:
        from ray._raylet import AuthenticationTokenLoader

        loader = AuthenticationTokenLoader.instance()
        loader.reset_cache()  # HOME or the variables may have changed since it last looked
        return bool(loader.has_token(ignore_auth_mode=True))
    except (ImportError, AttributeError, TypeError):
        if os.environ.get("RAY_AUTH_TOKEN", "").strip():
            return True
        custom = os.environ.get("RAY_AUTH_TOKEN_PATH")
        return Path(custom).is_file() if custom else default_token_path().is_file()


def client_auth_mode(address: str) -> str | None:
    """``RAY_AUTH_MODE`` for joining ``address``: a value the user set wins; else ``token`` when
    the cluster wants a token (``cluster_wants_token``), set in the environment (Ray reads it
    there) and returned; else unset (None). ``ray start --head`` turns token auth on by itself
    when ``RAY_AUTH_MODE`` is unset and a token is at hand (``~/.ray/auth_token``, which any
    ``ray_address: local`` run writes: Ray's ``maybe_enable_token_auth_if_token_available``), but
    ``ray.init(address=...)`` never does, so without this the client is refused. The cluster is
    asked rather than the file looked at: one started otherwise (``RAY_AUTH_MODE=disabled``,
    ``ray.cluster_utils.Cluster``) has no token auth even where a token file exists, and a
    token-mode client there broke tests/test_ray.py's runs (their trainer actor died)."""
    if AUTH_MODE_ENV in os.environ:
        return os.environ[AUTH_MODE_ENV]
    if not cluster_wants_token(address):
        return None
    os.environ[AUTH_MODE_ENV] = "token"
    try:  # Ray caches its config (the auth mode among it): refresh it, as Ray itself does
        from ray._raylet import Config

        Config.initialize("")
    except (ImportError, AttributeError):
        pass
    return "token"


def _auth_failure(err: BaseException) -> bool:
    """Whether ``ray.init``'s error (or one it was raised from) is the cluster refusing our token."""
    seen: BaseException | None = err
    for _ in range(10):
        if seen is None:
            return False
        if type(seen).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _join(address: str) -> None:
    """``ray.init(address)`` for an existing cluster: probe first, client auth as the head's,
    and a refused token as one line saying what to set."""
    import ray

    if address != "auto":  # "auto": Ray finds a cluster started on this machine itself
        probe_address(address)
    mode = client_auth_mode(address)
    try:
        ray.init(address=address, namespace=NAMESPACE, logging_level="WARNING")
    except Exception as err:
        if not _auth_failure(err):
            raise
        ray.shutdown()
        have = "a token" if token_available() else "no token"
        raise ConnectionError(
            f"cluster.ray_address={address}: the cluster wants a Ray auth token this client lacks "
            f"or does not match (InvalidAuthToken; RAY_AUTH_MODE={mode or 'unset'}, {have} here): "
            f"export RAY_AUTH_MODE=token and give this machine the cluster's token "
            f"(~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN), as on every node "
            f"(docs/cluster.md)") from None


def connect(cfg_cluster: ClusterConfig, user: str, num_cpus: int | None = None) -> RayConnection:
    """Start (``local``) or join (an address) Ray once per process; every user ``release``s.

    ``local`` listens on 127.0.0.1 only and offers ``max(cpu count, num_cpus)`` logical CPUs
    (logical: engines and trainer can share cores on a small machine). An address is probed
    first (nothing answering: one ``ConnectionError`` within ``PROBE_TIMEOUT_S``, never Ray's
    ~14-minute retry) and joined in token-auth mode when a token is at hand (``_join``)."""
    if cfg_cluster.ray_address is None:
        raise ValueError("cluster.ray_address is null: this run does not use Ray")
    current = _CONNECTION.get("current")
    if current is not None:
        current.users.append(user)
        return current
    prepare_ray(loopback=is_loopback(cfg_cluster.ray_address))
    import ray

    if ray.is_initialized():  # someone else (a test, a notebook) started Ray: use it, never stop it
        conn = RayConnection(address="existing", owns_init=False, users=[user])
    elif cfg_cluster.ray_address == "local":
        want = max(os.cpu_count() or 1, cfg_cluster.num_cpus or 0, num_cpus or 0)
        ray.init(address="local", num_cpus=want, include_dashboard=False, namespace=NAMESPACE,
                 _node_ip_address="127.0.0.1", log_to_driver=True,
                 logging_level="WARNING", configure_logging=True)
        conn = RayConnection(address="local", owns_init=True, users=[user])
    else:
        _join(cfg_cluster.ray_address)
        conn = RayConnection(address=cfg_cluster.ray_address, owns_init=True, users=[user])
    _CONNECTION["current"] = conn
    return conn


def bundle(num_cpus: float, num_gpus: float, resources: dict[str, float]) -> dict[str, float]:
    """One placement-group bundle: {"CPU": c, "GPU": g, **custom}, zero entries left out."""
    out = {"CPU": float(num_cpus), "GPU": float(num_gpus), **{k: float(v) for k, v in resources.items()}}
    return {k: v for k, v in out.items() if v > 0}


def placement_group(bundles: list[dict[str, float]], strategy: str, what: str,
                    timeout_s: float) -> Any:
    """A ready placement group, or one clear error naming what could not be placed."""
    import ray
    from ray.util.placement_group import placement_group as make_pg
    from ray.util.placement_group import remove_placement_group

    pg = make_pg(bundles, strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(f"{what}: Ray could not place {len(bundles)} x {bundles[0]} "
                           f"({strategy}) within {timeout_s:.0f}s; the cluster offers "
                           f"{ray.available_resources()}")
    return pg


def actor_options(pg: Any, index: int, num_cpus: float, num_gpus: float,
                  resources: dict[str, float], **extra: Any) -> dict[str, Any]:
    """``.options(...)`` placing an actor in bundle ``index`` of ``pg``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"num_cpus": num_cpus, "num_gpus": num_gpus, "resources": dict(resources),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=index), **extra}
