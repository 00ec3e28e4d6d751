"""Where a Ray deployment's replicas run: Ray start-up, and one placement bundle per replica with
the CPUs, GPU share and custom resources that replica reserves.

    placement group (ray.placement_strategy: PACK, SPREAD, ...)
      bundle 0: {CPU: cpus_per_replica, GPU: gpus_per_replica, memory: bytes,
                 **resources_per_replica}
      (unset: the machine's cores shared among the replicas, see ``cpus_per_replica``)
      bundle 1: ...
      replica i runs in bundle i and reserves all of it

``memory`` is the host memory the replica will hold (``replicas.kv.sizing.replica_memory``):
on a CPU its weights, NPU KV pool and host tier, with the pool sized here, before the replicas
start, from the memory Ray schedules on a node shared by all of them, and pinned in their
config (``ReplicaPlacement.pinned``), so that every replica gets the pool it declared; on a GPU
its host tier (the pool is in HBM, sized by the replica). Ray's placement and its memory
monitor then see what each replica holds.

A resize keeps the bundle of every replica as it was at start-up. A replica removed by a
scale-in frees its bundle: the next replica a scale-out adds takes a free bundle before a new
placement group of one bundle is reserved; a group all of whose bundles are free is removed
(Ray cannot shrink a placement group, so a start-up group stays reserved while one of its
replicas runs). ``placement_strategy`` spreads or packs the replicas of one group; replicas
added later are placed wherever their one-bundle group fits.

A replica uses a GPU only when its bundle reserves one (``replicas.actor.placed_device``), so
two replicas never share a GPU unknowingly.
"""

import asyncio
import logging
import math
import os
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import RayConfig
from replicas.config import EngineConfig
from replicas.kv.sizing import ReplicaMemory, replica_memory
from replicas.model import ModelArgs
from replicas.model.loader import checkpoint_bytes

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0
"""How long start-up, or a scale-out that fits the Ray cluster now, waits for Ray to place its
bundles (a scale-out that does not fit waits ``ray.scale_out_wait_s``, ``cluster.resize``)."""


def init_ray(config: RayConfig) -> None:
    """Join ``config.address``, or start an embedded local Ray sized for this machine: always a
    new instance (``address="local"``), never a head that happens to run here already."""
    if ray.is_initialized():
        return
    if config.address:
        ray.init(address=config.address, namespace=config.namespace, log_to_driver=True)
    else:
        ray.init(
            address="local",
            num_cpus=config.num_cpus or os.cpu_count(),
            namespace=config.namespace,
            include_dashboard=False,
            log_to_driver=True,
        )


def is_embedded(config: RayConfig) -> bool:
    """Whether ``init_ray`` will start a Ray instance on this machine (no cluster to join)."""
    return not (config.address or ray.is_initialized())


def can_grow(config: RayConfig) -> bool:
    """Whether the Ray cluster a deployment of ``config`` runs on may gain nodes (Ray's
    autoscaler, KubeRay, ``ray start --address`` on another machine): one joined by address,
    not a Ray instance this process starts or started on this machine (``init_ray``'s embedded
    one, or a ``ray.init()`` without an address made before the deployment). Asked before
    ``init_ray``."""
    if is_embedded(config):
        return False
    if not ray.is_initialized():
        return True  # init_ray joins config.address
    node = getattr(ray._private.worker, "_global_node", None)  # None for a Ray Client
    return not getattr(node, "head", False)


def gpus_per_replica(config: RayConfig, device: str, num_replicas: int) -> float:
    """``ray.gpus_per_replica``, or when unset: one GPU per replica if the cluster has one for
    each and the device allows CUDA, else none."""
    if config.gpus_per_replica is not None:
        return config.gpus_per_replica
    if device == "cpu" or ray.cluster_resources().get("GPU", 0) < num_replicas:
        return 0.0
    logger.info(
        "the Ray cluster has a GPU for each of %d replicas: one GPU per replica", num_replicas
    )
    return 1.0


@dataclass(slots=True)
class ReplicaPlacement:
    """Ready placement bundles, one per replica: those of the start-up group, and those that
    ``reserve`` added for a scale-out. Owns which replica holds which bundle."""

    placement_group: PlacementGroup
    num_cpus: float
    num_gpus: float
    resources: dict[str, float]
    memory_bytes: int = 0
    """Host memory each replica declares (Ray's ``memory`` resource); 0: none declared."""
    npu_kv_memory_bytes: int | None = None
    """The NPU KV pool sized for each replica here (CPU replicas); None: each sizes its own."""
    bundles: dict[int, tuple[PlacementGroup, int]] = field(default_factory=dict)
    """Replica index -> (group, bundle index) it runs in."""
    free: list[tuple[PlacementGroup, int]] = field(default_factory=list)
    """Reserved bundles no replica holds (freed by a scale-in)."""

    def __post_init__(self) -> None:
        if not self.bundles:
            count = len(self.placement_group.bundle_specs)
            self.bundles = {i: (self.placement_group, i) for i in range(count)}

    @property
    def bundle(self) -> dict[str, float]:
        """What one replica reserves."""
        return _bundle(self.num_cpus, self.num_gpus, self.memory_bytes, self.resources)

    def pinned(self, config: EngineConfig) -> EngineConfig:
        """``config`` with the NPU KV pool sized for each replica here, if one was."""
        if self.npu_kv_memory_bytes is None:
            return config
        return config.model_copy(update={"npu_kv_memory_bytes": self.npu_kv_memory_bytes})

    def actor_options(self, index: int) -> dict[str, object]:
        """Ray actor options that put replica ``index`` in its bundle, reserving all of it."""
        group, bundle_index = self.bundles[index]
        options: dict[str, object] = {
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "resources": self.resources,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, bundle_index),
        }
        if self.memory_bytes:
            options["memory"] = self.memory_bytes
        return options

    def num_placeable(self) -> float:
        """How many more replicas the cluster can hold now: the free bundles, plus the bundles
        that fit in the available resources (``inf`` for a bundle of no resources). Counts the
        cluster's totals, so a bundle too large for any one node does not fit now, and the rest
        is left to Ray's placement (``reserve`` fails when it cannot place in time)."""
        bundle = {k: v for k, v in self.bundle.items() if v > 0}
        if not bundle:
            return math.inf
        largest = {
            k: max((n["Resources"].get(k, 0.0) for n in ray.nodes() if n["Alive"]), default=0.0)
            for k in bundle
        }
        if any(largest[k] < v for k, v in bundle.items()):
            return float(len(self.free))
        available = ray.available_resources()
        fits = min(int(available.get(k, 0.0) / v + 1e-9) for k, v in bundle.items())
        return float(len(self.free) + fits)

    def describe_shortfall(self, num_new: int) -> str:
        """Why ``num_new`` more replicas do not fit: one sentence naming the resources."""
        return (
            f"{num_new} more replica(s) need {self.bundle} each, and the Ray cluster has "
            f"{len(self.free)} free bundle(s) and {self.available()} available"
        )

    def available(self) -> dict[str, float]:
        """What the Ray cluster has available now of each resource a bundle reserves."""
        available = ray.available_resources()
        return {k: round(available.get(k, 0.0), 3) for k in self.bundle}

    async def reserve(self, indices: list[int], timeout_s: float = PLACEMENT_TIMEOUT_S) -> None:
        """Give each new replica of ``indices`` a bundle: a free one, else a new one-bundle
        group. The new groups are reserved together (pending ones are the demand Ray's
        autoscaler sees) and waited for up to ``timeout_s``. Raises ``PlacementTimeout``
        (having given back every bundle this call took, its new groups removed) when Ray has
        not placed them all by then."""
        taken: list[int] = []
        new: list[PlacementGroup] = []
        try:
            for index in indices:
                if self.free:
                    self.bundles[index] = self.free.pop()
                else:
                    new.append(placement_group([dict(self.bundle)], strategy="PACK"))
                    self.bundles[index] = (new[-1], 0)
                taken.append(index)
            num_placed = await _wait_placed(new, timeout_s)
            if num_placed < len(new):
                raise PlacementTimeout(
                    f"Ray placed {num_placed} of {len(new)} new placement group(s) of "
                    f"{self.bundle} within {timeout_s:g} s ({self.available()} available)"
                )
        except BaseException:
            for index in taken:
                if index in self.bundles:  # not if ``remove`` (a shutdown) came first
                    self.release(index)
            raise

    def release(self, index: int) -> None:
        """Replica ``index`` no longer runs: its bundle is free; a group with no replica left
        in it is removed."""
        group, bundle_index = self.bundles.pop(index)
        self.free.append((group, bundle_index))
        if not any(g is group for g, _ in self.bundles.values()):
            self.free = [(g, b) for g, b in self.free if g is not group]
            remove_placement_group(group)

    def remove(self) -> None:
        groups = {id(g): g for g, _ in [*self.bundles.values(), *self.free]}
        for group in groups.values():
            remove_placement_group(group)
        self.bundles.clear()
        self.free.clear()


class PlacementTimeout(RuntimeError):
    """Ray did not place a scale-out's new placement groups in time."""


async def _wait_placed(groups: list[PlacementGroup], timeout_s: float) -> int:
    """Wait up to ``timeout_s`` for Ray to place every one of ``groups``; how many it placed."""
    if not groups:
        return 0

    async def placed(group: PlacementGroup) -> None:
        await group.ready()

    waits = [asyncio.ensure_future(placed(group)) for group in groups]
    try:
        done, _ = await asyncio.wait(waits, timeout=timeout_s)
    finally:
        for wait in waits:
            wait.cancel()
    for wait in done:
        wait.result()  # a group Ray failed to place raises here
    return len(done)


FRONT_RESERVED_CPUS = 1.0
"""CPUs a default deployment leaves unreserved for the HTTP front and the router, on a Ray
cluster with at least ``MIN_CPUS_TO_RESERVE`` of them; a smaller machine shares every core
(the front and the router need little of one, and an idle reserved core is a larger loss)."""
MIN_CPUS_TO_RESERVE = 8.0


def cpus_per_replica(config: RayConfig, num_gpus: float, num_replicas: int) -> float:
    """``ray.cpus_per_replica``, or when unset: one CPU per replica that runs on a GPU; on the
    CPU, the Ray cluster's available CPUs (less ``FRONT_RESERVED_CPUS`` on a large one) shared
    evenly among the replicas, at most one node's CPUs each. A replica computes with one torch
    thread per whole CPU it reserves (``cluster.deploy``)."""
    if config.cpus_per_replica is not None:
        return config.cpus_per_replica
    if num_gpus:
        return 1.0
    available = ray.available_resources().get("CPU", 0.0)
    if available >= MIN_CPUS_TO_RESERVE:
        available -= FRONT_RESERVED_CPUS
    largest_node = max(
        (node["Resources"].get("CPU", 0.0) for node in ray.nodes() if node["Alive"]), default=0.0
    )
    share = min(available / num_replicas, largest_node)
    if share >= 1:
        share = float(int(share))  # whole CPUs: a fraction would buy no thread
    return max(share, 0.0)


def _bundle(
    num_cpus: float, num_gpus: float, memory_bytes: int, resources: dict[str, float]
) -> dict[str, float]:
    bundle = {"CPU": num_cpus, **resources}
    if num_gpus:
        bundle["GPU"] = num_gpus
    if memory_bytes:
        bundle["memory"] = memory_bytes
    return bundle


def plan_replica_memory(
    engine_config: EngineConfig, args: ModelArgs, num_gpus: float, num_replicas: int
) -> ReplicaMemory:
    """One replica's host memory (``replicas.kv.sizing.replica_memory``), its CPU pool sized
    from the smallest alive node's ``memory`` resource shared by every replica (a replica
    spread to another node then holds less than that node could give it)."""
    node_memory = min(
        (n["Resources"].get("memory", 0.0) for n in ray.nodes() if n["Alive"]), default=0.0
    )
    return replica_memory(
        args,
        engine_config,
        on_gpu=bool(num_gpus),
        node_memory_bytes=int(node_memory),
        num_node_replicas=num_replicas,
        checkpoint_bytes=checkpoint_bytes(engine_config.model, engine_config.revision),
    )


def place_replicas(
    config: RayConfig, engine_config: EngineConfig, args: ModelArgs, num_replicas: int
) -> ReplicaPlacement:
    """Reserve one bundle per replica, its memory included (``plan_replica_memory``), and wait
    until Ray has placed them all. Raises ``RuntimeError`` (having released the reservation)
    when the cluster cannot hold them."""
    device = engine_config.device
    num_gpus = gpus_per_replica(config, device, num_replicas)
    num_cpus = cpus_per_replica(config, num_gpus, num_replicas)
    memory = plan_replica_memory(engine_config, args, num_gpus, num_replicas)
    logger.info("each replica declares %d bytes of memory to Ray: %s", *memory[1:])
    bundle = _bundle(num_cpus, num_gpus, memory.declared_bytes, config.resources_per_replica)
    if not num_gpus and device == "auto" and ray.cluster_resources().get("GPU"):
        logger.warning(
            "the Ray cluster has GPUs but no replica reserves one (ray.gpus_per_replica): "
            "replicas run on the CPU (a replica uses a GPU only when its placement bundle "
            "reserves one)"
        )
    group = placement_group([dict(bundle)] * num_replicas, strategy=config.placement_strategy)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except GetTimeoutError as error:
        remove_placement_group(group)
        raise RuntimeError(
            f"cannot place {num_replicas} replicas needing {bundle} each on this Ray cluster "
            f"({ray.cluster_resources()}); lower data_parallel_size or ray.cpus_per_replica, "
            "or set npu_kv_memory_bytes lower"
        ) from error
    return ReplicaPlacement(
        group,
        num_cpus,
        num_gpus,
        config.resources_per_replica,
        memory.declared_bytes,
        memory.npu_kv_memory_bytes,
    )
