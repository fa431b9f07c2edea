"""``ray``: one Ray actor per stage, placed by a placement group.

Ray places and starts the stage processes and reports their deaths; the per-step control path
is the same socket path as ``mp`` (see ``pprun.executor.remote``), so a step costs no Ray task
round trip.  Attaches to a running cluster when ``RAY_ADDRESS`` or ``parallel.ray_address`` names
one; otherwise starts a light local one (no dashboard, no usage stats, a short temp dir).
"""

from __future__ import annotations

import logging
import os
import tempfile

from pprun.distributed.layout import StageLayout
from pprun.executor.remote import RemoteStagesExecutor, worker_main
from pprun.worker.worker import WorkerSpec

logger = logging.getLogger(__name__)


def ensure_ray(address: str | None, num_cpus_needed: float) -> bool:
    """Connect to or start Ray; returns True when this call started a local cluster."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(
        include_dashboard=False,
        num_cpus=max(os.cpu_count() or 1, num_cpus_needed),
        object_store_memory=80 * 2**20,
        _temp_dir=temp_dir,
        log_to_driver=True,
        configure_logging=False,
    )
    return True


class RayExecutor(RemoteStagesExecutor):
    """Stages as Ray actors in a placement group (one GPU each on GPU, a CPU fraction on CPU)."""

    name = "ray"

    def __init__(self, resolved, runner: str, fault_injection: dict[int, dict] | None = None) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__(resolved, resolved.cfg.parallel.stage_timeout_s, runner)
        par = resolved.cfg.parallel
        on_gpu = resolved.device == "cuda"
        cpus = par.ray_num_cpus_per_stage
        # A local cluster started here stays up for the process (a later LLM reuses it).
        ensure_ray(par.ray_address, cpus * self.pp_size)
        bundle = {"GPU": 1, "CPU": cpus} if on_gpu else {"CPU": cpus}
        self.pg = placement_group([dict(bundle) for _ in range(self.pp_size)], strategy="PACK")
        self._remove_pg = remove_placement_group
        self.actors = []
        try:
            ray.get(self.pg.ready(), timeout=par.stage_timeout_s + 60)
        except ray.exceptions.GetTimeoutError:
            self.shutdown(graceful=False)
            raise ValueError(
                f"Ray could not place {self.pp_size} stages of {bundle} within "
                f"{par.stage_timeout_s + 60:.0f}s: the cluster lacks the resources "
                f"(ray.cluster_resources()={ray.cluster_resources()})"
            ) from None

        @ray.remote
        class StageActor:
            """Hosts one stage; ``run`` serves steps until shutdown."""

            def node_ip_and_port(self) -> tuple[str, int]:
                from pprun.executor.mp import free_port

                ip = ray.util.get_node_ip_address()
                return ip, free_port("0.0.0.0")

            def run(self, spec, address, authkey) -> None:
                worker_main(address, authkey, spec.layout.pp_rank, spec)

        self.actors = [
            StageActor.options(
                num_cpus=cpus,
                num_gpus=1 if on_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank
                ),
                name=None,
            ).remote()
            for rank in range(self.pp_size)
        ]
        try:
            ip0, port0 = ray.get(self.actors[0].node_ip_and_port.remote(), timeout=par.stage_timeout_s + 60)
            driver_ip = ray.util.get_node_ip_address()
            listener = self._listen(driver_ip)
            self.run_refs = []
            for rank, actor in enumerate(self.actors):
                spec = WorkerSpec(
                    resolved,
                    StageLayout.from_partition(resolved.layer_partition, rank),
                    runner,
                    init_method=f"tcp://{ip0}:{port0}",
                    device_index=0 if on_gpu else None,  # Ray sets CUDA_VISIBLE_DEVICES per actor
                    sample_feedback_slots=self.sample_feedback_slots,
                    control_spin_s=self.spin_s,
                    fault_injection=(fault_injection or {}).get(rank),
                )
                self.run_refs.append(actor.run.remote(spec, listener.address, self.authkey))
            self._accept_all(listener)
            self._setup_stages()
        except BaseException:
            self.shutdown()
            raise

    def describe(self) -> str:
        """Executor and placement."""
        return f"ray ({self.pp_size} actors)"

    def _stage_exits(self) -> list[tuple[int, str]]:
        import ray

        refs = getattr(self, "run_refs", [])
        if not refs:
            return []
        done, _ = ray.wait(refs, timeout=0, num_returns=len(refs))
        exits = []
        for ref in done:
            rank = refs.index(ref)
            try:
                ray.get(ref)
                why = "returned early"
            except Exception as e:  # the actor died: RayActorError and friends
                first = str(e).splitlines()[0] if str(e) else ""
                why = f"died ({type(e).__name__}: {first})"
            exits.append((rank, f"stage {rank} actor {why}"))
        return exits

    def _stop_processes(self, grace_s: float) -> None:
        import ray

        refs = getattr(self, "run_refs", [])
        if refs and grace_s > 0:
            ray.wait(refs, timeout=grace_s, num_returns=len(refs))
        for actor in getattr(self, "actors", []):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        if getattr(self, "pg", None) is not None:
            try:
                self._remove_pg(self.pg)
            except Exception:
                pass
            self.pg = None
        self.actors = []
        self.run_refs = []
