"""``ray``: one Ray actor per worker (per tp rank of each stage), placed by a placement group.

Ray places and starts the stage processes and reports their deaths; the per-step control path
is the same socket path as ``mp`` (see ``pprun.executor.remote``), so a step costs no Ray task
round trip.  Attaches to a running cluster when ``RAY_ADDRESS`` or ``parallel.ray_address`` names
one; otherwise starts a light local one (no dashboard, no usage stats, a short temp dir) that
listens on loopback only and asks for a per-cluster token (:func:`start_local_ray`,
``docs/security.md``).

Placement (``docs/cluster.md``): one bundle per stage, spread over nodes by
``parallel.placement_strategy`` and pinned by ``parallel.stage_resources``; a placement the
cluster can never hold fails at once.  With tensor parallelism a stage's bundle holds its tp
workers' resources together (``tp`` GPUs, ``tp x ray_num_cpus_per_stage`` CPUs) and its tp
actors share it, one GPU each: a bundle lives on one node, so a stage's tp group is always
packed within a node (its all-reduces stay on NVLink), while the strategy spreads the stages as
it does without tp.  (Bundles of one GPU each would let ``SPREAD`` split a stage's group over
nodes: Ray applies one strategy to a whole placement group.)  Stages on other nodes than the driver's meet at stage 0's
node address as Ray reports it, never at a hard-coded loopback, in an authenticated rendezvous
store stage 0 serves there (``pprun.distributed.rendezvous``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

from pprun.config.validate import ResolvedConfig
from pprun.distributed.auth import loopback_env
from pprun.distributed.layout import StageLayout
from pprun.executor.remote import RemoteStagesExecutor, worker_main
from pprun.worker.faults import stage_faults
from pprun.worker.worker import WorkerSpec

logger = logging.getLogger(__name__)


LOCAL_NODE_ADDRESS = "127.0.0.1"
"""Node address of a local cluster pprun starts: every Ray process of it listens on loopback."""
TOKEN_DIR = "pprun-auth"
"""Directory (mode 0700) of the local cluster's token, inside the cluster's temp directory."""
TOKEN_FILE = "auth_token"
"""Name of the local cluster's Ray token file (mode 0600), in :data:`TOKEN_DIR`."""
LOCAL_ADDRESS_VAR = "PPRUN_LOCAL_RAY_ADDRESS"
"""Set by :func:`start_local_ray` for the processes this one starts: the local cluster's GCS
address.  A process given that address attaches over loopback (:func:`ensure_ray`)."""
_LOCAL_CLUSTER_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", LOCAL_ADDRESS_VAR)
"""The variables :func:`start_local_ray` sets for its cluster (and :func:`stop_local_ray` unsets)."""
_set_by_pprun: list[str] = []
"""Which of :data:`_LOCAL_CLUSTER_VARS` the running local cluster's start set (a user's stay)."""


def ensure_ray(address: str | None, num_cpus_needed: float) -> bool:
    """Connect to or start Ray; returns True when this call started a local cluster.

    A cluster named by ``address`` or ``RAY_ADDRESS`` is the user's: pprun attaches with that
    cluster's own settings (its node addresses, its authentication).  Otherwise pprun starts a
    local one closed to the network (:func:`start_local_ray`), stopped at the interpreter's exit."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        # A local cluster a parent process started (tests, a server's engine): Ray would replace
        # its loopback address by the host's, where nothing of that cluster listens.
        on_loopback = address == os.environ.get(LOCAL_ADDRESS_VAR)
        with _loopback_node() if on_loopback else contextlib.nullcontext():
            ray.init(address=address, log_to_driver=True)
        return False
    temp_dir = start_local_ray(max(os.cpu_count() or 1, num_cpus_needed))
    # Runs before Ray's own exit hook (registered when ray was imported: last in, first out).
    atexit.register(stop_local_ray, temp_dir=temp_dir)
    return True


def start_local_ray(num_cpus: float, log_to_driver: bool = True) -> str:
    """Start a light local Ray cluster that only this host's loopback can reach and that asks
    every client for a per-cluster token; returns its private temp directory (for
    :func:`stop_local_ray`).

    Light: no dashboard, no usage stats, an 80 MiB object store, a short temp directory (Ray's
    socket paths have a length limit).  Closed (``docs/security.md``):

    * node address ``127.0.0.1``: the GCS, the raylet, Ray's agents and its workers listen on
      loopback only;
    * Ray's token authentication (``RAY_AUTH_MODE=token``) with a fresh 256-bit token in
      ``TEMP_DIR/pprun-auth/auth_token`` (mode 0600, its directory 0700: Ray makes ``TEMP_DIR``
      itself 0777), named to the cluster's processes by ``RAY_AUTH_TOKEN_PATH``.  A user who set
      ``RAY_AUTH_MODE`` keeps their mode (``disabled`` is an opt-out by name, logged), and one
      who set ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH`` keeps their token.
    """
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # mode 0700
    _enable_token_auth(temp_dir)
    try:
        with _loopback_node():
            ray.init(
                include_dashboard=False,
                num_cpus=num_cpus,
                object_store_memory=80 * 2**20,
                _temp_dir=temp_dir,
                _node_ip_address=LOCAL_NODE_ADDRESS,
                log_to_driver=log_to_driver,
                configure_logging=False,
            )
    except BaseException:
        _restore_auth_env()
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    if LOCAL_ADDRESS_VAR not in os.environ:
        os.environ[LOCAL_ADDRESS_VAR] = ray.get_runtime_context().gcs_address
        _set_by_pprun.append(LOCAL_ADDRESS_VAR)
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOCAL_NODE_ADDRESS:
        logger.warning(
            "the local Ray cluster's node address is %s, not %s: this Ray version does not keep a local "
            "cluster on loopback, so its ports are reachable from the network (with its token, where "
            "RAY_AUTH_MODE=token)", node_ip, LOCAL_NODE_ADDRESS,
        )
    return temp_dir


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """During ``ray.init``: let ``_node_ip_address="127.0.0.1"`` stand.

    ``ray.init`` replaces a loopback node address by the host's network address unless Ray runs
    as a local-only installation (its ``ENABLE_RAY_CLUSTER`` constant, false on macOS and
    Windows); with it false the address stays loopback, and Ray binds its servers to it."""
    from ray._private import ray_constants

    missing = object()
    previous = getattr(ray_constants, "ENABLE_RAY_CLUSTER", missing)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if previous is missing:
            del ray_constants.ENABLE_RAY_CLUSTER
        else:
            ray_constants.ENABLE_RAY_CLUSTER = previous


def _refresh_ray_auth() -> None:
    """Make this process's Ray read ``RAY_AUTH_*`` again (it caches its config and the token when
    it is imported); a Ray without token authentication has nothing to refresh."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:
        return
    Config.initialize("")  # before the token cache: Ray's own order when it changes the mode
    AuthenticationTokenLoader.instance().reset_cache()


def ray_supports_token_auth() -> bool:
    """Whether the installed Ray has token authentication (``RAY_AUTH_MODE=token``)."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config  # noqa: F401
    except ImportError:
        return False
    return True


def _enable_token_auth(temp_dir: str) -> None:
    """Turn Ray's token authentication on for the local cluster about to start (see
    :func:`start_local_ray`), writing its token into ``temp_dir``."""
    _set_by_pprun.clear()
    mode = os.environ.get("RAY_AUTH_MODE")
    if not ray_supports_token_auth():
        logger.warning(
            "the installed Ray has no token authentication: the local cluster (on loopback) accepts any "
            "client of this host; install a Ray with RAY_AUTH_MODE=token support to close it"
        )
        return
    if mode is not None and mode.lower() != "token":
        logger.warning(
            "RAY_AUTH_MODE=%s is set: the local Ray cluster starts without token authentication, so any "
            "process of this host can run code in it (unset RAY_AUTH_MODE for a per-cluster token)", mode,
        )
        return
    if mode is None:
        os.environ["RAY_AUTH_MODE"] = "token"
        _set_by_pprun.append("RAY_AUTH_MODE")
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        # A directory of its own: Ray opens its temp directory to everyone (mode 0777).
        private = os.path.join(temp_dir, TOKEN_DIR)
        os.mkdir(private, 0o700)
        path = os.path.join(private, TOKEN_FILE)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        os.environ["RAY_AUTH_TOKEN_PATH"] = path
        _set_by_pprun.append("RAY_AUTH_TOKEN_PATH")
    _refresh_ray_auth()


def _restore_auth_env() -> None:
    """Unset what :func:`start_local_ray` set (a later cluster makes its own token)."""
    if not _set_by_pprun:
        return
    for name in _set_by_pprun:
        os.environ.pop(name, None)
    _set_by_pprun.clear()
    _refresh_ray_auth()


STATELESS_PROCESSES = ("monitor", "dashboard", "log_monitor")
"""Processes of a local Ray node that hold nothing for the driver (the autoscaler monitor, the
dashboard head, the log monitor): :func:`stop_local_ray` stops them together."""


def stop_local_ray(grace_s: float = 0.2, temp_dir: str | None = None) -> None:
    """Stop the local cluster :func:`ensure_ray` started (at the interpreter's exit), then
    remove its private ``temp_dir`` (the session's sockets, logs and spilled objects: a run of
    ``pprun generate`` left a directory of about 0.2 MB in /tmp each time).

    Ray's exit hook first sleeps half a second, then stops the node's processes one after
    another, giving each up to a second to exit on SIGTERM before SIGKILL; the autoscaler
    monitor does not exit on SIGTERM, so it costs the whole second (2.2 s of every ``pprun
    generate`` on a 2-core host in all).  Here the processes that hold nothing for the driver
    stop together first: the monitor at once by SIGKILL (what Ray ends up sending it; on SIGTERM
    it would report an autoscaler failure to the still connected driver), the dashboard head
    and the log monitor by SIGTERM, and SIGKILL after ``grace_s``.  ``ray.shutdown`` then
    disconnects the driver and stops the raylet (which ends its workers) and the GCS as Ray
    does, without the pause.  Should Ray's node object look different, only ``ray.shutdown``
    runs."""
    import ray

    if not ray.is_initialized():  # shut down by someone else already: only the leftovers here
        _restore_auth_env()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
        return
    try:
        node = ray._private.worker._global_node
        live = [
            (kind, info.process)
            for kind in STATELESS_PROCESSES
            for info in (node.all_processes.get(kind, []) if node is not None else [])
            if info.process.poll() is None
        ]
        for kind, p in live:
            if kind == "monitor":
                p.kill()
            else:
                p.terminate()
        deadline = time.monotonic() + grace_s
        for _, p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=1.0)
    except Exception:
        logger.debug("stopping Ray's stateless processes first failed", exc_info=True)
    ray.shutdown()
    # Before the token file goes with the directory: Ray reads the token again while the mode says so.
    _restore_auth_env()
    if temp_dir is not None:
        shutil.rmtree(temp_dir, ignore_errors=True)


def check_placement_possible(bundles: list[dict[str, float]], strategy: str) -> None:
    """Fail at once, naming the setting, where the cluster can never hold the placement group
    (Ray would wait for resources forever): a custom resource no node has, or ``STRICT_SPREAD``
    over fewer alive nodes than stages."""
    import ray

    total = ray.cluster_resources()
    for rank, bundle in enumerate(bundles):
        for name, amount in bundle.items():
            if name not in ("CPU", "GPU") and total.get(name, 0) < amount:
                raise ValueError(
                    f"parallel.stage_resources[{rank}].{name}={amount} cannot be reserved: the Ray cluster has "
                    f"{total.get(name, 0)} of it (start a node with `ray start ... --resources "
                    f"'{{\"{name}\": {amount}}}'`, or change the setting)"
                )
    if strategy == "STRICT_SPREAD":
        alive = sum(1 for node in ray.nodes() if node.get("Alive"))
        if alive < len(bundles):
            raise ValueError(
                f"parallel.placement_strategy=STRICT_SPREAD puts each of the {len(bundles)} stages on a node of its "
                f"own, but the Ray cluster has {alive} alive node{'s' if alive != 1 else ''}; add nodes or use "
                "PACK or SPREAD"
            )


class RayExecutor(RemoteStagesExecutor):
    """Stages as Ray actors in a placement group (one GPU each on GPU, a CPU fraction on CPU)."""

    name = "ray"

    @classmethod
    def prepare(cls, resolved: ResolvedConfig) -> None:
        """Import Ray, and where this process will start a local cluster (no ``ray_address``,
        no ``RAY_ADDRESS``, Ray not started yet) the dashboard's dependencies, which
        ``ray.init`` imports to check them before it starts the dashboard head (aiohttp,
        OpenTelemetry, Prometheus: half a second of the cluster's start on a 2-core host)."""
        import ray

        if not ray.is_initialized() and not (resolved.cfg.parallel.ray_address or os.environ.get("RAY_ADDRESS")):
            ray._private.utils.get_dashboard_dependency_error()

    def __init__(self, resolved: ResolvedConfig, runner: str) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # Set first: shutdown (on any failure below) reads them however far start-up got.
        self.pg = None
        """The placement group (one bundle per stage); None once removed."""
        self.actors: list = []
        """The stage actors, first to last."""
        self.run_refs: list = []
        """Each actor's ``run`` call: done only when its stage returned or died."""
        self.stage_node_ids: list[str] = []
        """Ray node id of each stage's actor, first to last."""
        self.stage_ips: list[str] = []
        """Each stage's node address as Ray reports it (the rendezvous host across nodes)."""
        super().__init__(resolved, resolved.cfg.parallel.stage_timeout_s, runner)
        par = resolved.cfg.parallel
        on_gpu = resolved.device == "cuda"
        cpus = par.ray_num_cpus_per_stage
        # A local cluster started here stays up for the process (a later LLM reuses it).
        t0 = time.perf_counter()
        tp = self.tp_size
        started = ensure_ray(par.ray_address, cpus * self.num_workers)
        t1 = time.perf_counter()
        extra = [dict(r) for r in par.stage_resources] if par.stage_resources else [{}] * self.pp_size
        # One bundle per stage, holding its tp workers (see the module docstring).
        base = {"GPU": tp, "CPU": cpus * tp} if on_gpu else {"CPU": cpus * tp}
        bundles = [{**base, **extra[rank]} for rank in range(self.pp_size)]
        strategy = par.placement_strategy
        self.placement_strategy = strategy
        check_placement_possible(bundles, strategy)
        self.pg = placement_group(bundles, strategy=strategy)
        self._remove_pg = remove_placement_group

        @ray.remote
        class StageActor:
            """Hosts one stage; ``run`` serves steps until shutdown."""

            def node_ip(self) -> str:
                return ray.util.get_node_ip_address()

            def open_rendezvous(self, authkey: bytes) -> str:
                """Stage 0 across nodes: serve the authenticated rendezvous store on this node's
                address (port chosen by the kernel and kept); returns its ``init_method``."""
                from pprun.distributed.rendezvous import RendezvousServer

                self.rendezvous = RendezvousServer(ray.util.get_node_ip_address(), authkey)
                return self.rendezvous.init_method

            def run(self, spec: WorkerSpec, address: tuple[str, int], authkey: bytes) -> None:
                worker_main(address, authkey, spec.layout.global_rank, spec)

        # Created at once: each starts (its imports) as soon as its bundle is placed.  Actor i is
        # the worker of global rank i (stage i // tp); a stage's custom resources are shared by
        # its tp actors.
        self.actors = [
            StageActor.options(
                num_cpus=cpus,
                num_gpus=1 if on_gpu else 0,
                resources={name: amount / tp for name, amount in extra[rank // tp].items()},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank // tp
                ),
                name=None,
            ).remote()
            for rank in range(self.num_workers)
        ]
        try:
            ray.get(self.pg.ready(), timeout=par.stage_timeout_s + 60)
        except ray.exceptions.GetTimeoutError:
            self.shutdown(graceful=False)
            raise ValueError(
                f"Ray could not place {self.pp_size} stages of {tp} worker{'s' if tp > 1 else ''} (bundles {bundles}, "
                f"parallel.placement_strategy={strategy}) within {par.stage_timeout_s + 60:.0f}s: the "
                f"cluster lacks the resources (ray.cluster_resources()={ray.cluster_resources()})"
            ) from None
        # Where Ray put each stage (docs/cluster.md): node ids by bundle, i.e. by stage.
        table = ray.util.placement_group_table(self.pg)
        self.stage_node_ids = [table["bundles_to_node_id"][rank] for rank in range(self.pp_size)]

        try:
            self.stage_ips = ray.get([a.node_ip.remote() for a in self.actors], timeout=par.stage_timeout_s + 60)
            t2 = time.perf_counter()
            driver_ip = ray.util.get_node_ip_address()
            # Every stage on the driver's node: loopback sockets and a file rendezvous, as mp does
            # (docs/security.md); across nodes the node addresses are needed, and the stages meet
            # at stage 0's authenticated store (pprun.distributed.rendezvous).
            local = self.stages_on_driver_node(driver_ip)
            listener = self._listen("127.0.0.1" if local else driver_ip)
            if local:
                init_method = self._local_rendezvous()
            else:
                init_method = ray.get(self.actors[0].open_rendezvous.remote(self.authkey), timeout=60)
            for rank, actor in enumerate(self.actors):
                spec = WorkerSpec(
                    resolved,
                    StageLayout.of_global_rank(resolved.layer_partition, rank, tp),
                    runner,
                    init_method=init_method,
                    device_index=0 if on_gpu else None,  # Ray sets CUDA_VISIBLE_DEVICES per actor
                    sample_feedback_slots=self.sample_feedback_slots,
                    control_spin_s=self.spin_s,
                    feedback_host="127.0.0.1" if local else None,
                    env=loopback_env() if local else {},
                    faults=stage_faults(rank),
                )
                self.run_refs.append(actor.run.remote(spec, listener.address, self.authkey))
            self._accept_all(listener)
            self._setup_stages()
            # Where the start-up goes (docs/performance.md, "Start-up").
            logger.info(
                "ray: %s in %.2fs, stage actors up (imports done) in %.2fs, stages joined and loaded in %.2fs",
                "local cluster started" if started else "cluster ready", t1 - t0, t2 - t1, time.perf_counter() - t2,
            )
        except BaseException:
            self.shutdown()
            raise

    def stages_on_driver_node(self, driver_ip: str) -> bool:
        """Whether every stage runs on the driver's node (then the stages meet over loopback and
        a file, as ``mp`` stages do)."""
        return all(ip == driver_ip for ip in self.stage_ips)

    def describe(self) -> str:
        """Executor and placement."""
        nodes = len(set(self.stage_node_ids))
        actors = f"{self.pp_size} actors" if self.tp_size == 1 else f"{self.num_workers} actors: {self.pp_size} stages x tp {self.tp_size}"
        return f"ray ({actors}, {self.placement_strategy} on {nodes} node{'s' if nodes != 1 else ''})"

    def _stage_exits(self, crashed_only: bool = False) -> list[tuple[int, str]]:
        import ray

        refs = self.run_refs
        if not refs:
            return []
        done, _ = ray.wait(refs, timeout=0, num_returns=len(refs))
        exits = []
        for ref in done:
            rank = refs.index(ref)
            try:
                ray.get(ref)
                if crashed_only:
                    continue
                why = "returned early"
            except Exception as e:  # the actor died: RayActorError and friends
                first = str(e).splitlines()[0] if str(e) else ""
                why = f"died ({type(e).__name__}: {first})"
            exits.append((rank, f"{self.worker_name(rank)} actor {why}"))
        return exits

    def _stop_processes(self, grace_s: float) -> None:
        import ray

        refs = self.run_refs
        if refs and grace_s > 0:
            ray.wait(refs, timeout=grace_s, num_returns=len(refs))
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        if self.pg is not None:
            try:
                self._remove_pg(self.pg)
            except Exception:
                pass
            self.pg = None
        self.actors = []
        self.run_refs = []
