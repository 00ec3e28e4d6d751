"""Resizing a running simulated cluster: ``Resize(time_s, n)`` events beside the trace's arrivals.

A resize to more replicas starts new ones at the next unused indices, as the deployment's
scale-out does (``cluster.deploy``): the router indexes a new replica's events
(``router.Router.add_replica``) while it warms from the node's shared disk tier (the simulated
replicas share one node): the disk's blocks, hottest first, into its empty host blocks, within
``ServerConfig.warm_start_budget_s`` (``SimulatedEngine.warm_from_disk``: the real
``KVCacheManager.start_warm``, each round's reads taking the profile's disk time); it announces
them, and once they have landed the router routes to it (``start_routing``), ramping its share
of cold prompts (cached on no replica, disk included) over ``RoutingConfig.ramp_s``. With
``SimConfig.announce_disk_blocks`` the router credits the node's disk blocks as the deployed
one does. A resize to fewer removes replicas by ``victim_rule``:

    cache-aware  the replica whose blocks the cluster can best do without
                 (``cluster.scaling.choose_victims``, the rule the real deployment uses: the
                 recent-hit weight of the blocks only it holds, blocks on the shared disk tier
                 not lost; ties the least loaded)
    random       a replica drawn at random (seeded)
    restart      every replica is replaced by a fresh one at the new size (NPU and host tiers
                 start empty and are not warmed, the disk tier stays); the requests the old
                 ones still held count
                 as ``num_interrupted``, the ones a real restart would lose, and are finished
                 by the old replicas here so that every figure covers the same requests

A removed replica drains: the router stops sending it requests (``set_draining``), the requests
it holds run to their end, then its NPU and host blocks that the disk tier lacks are written to
its disk slab (coldest first, so that its slab keeps the hottest) with their weights, at once,
and the router forgets it (``retire``, with its snapshot's disk blocks when they are announced)
once its last report is delivered. Blocks' recent-hit weights are the
engine's rule (``replicas.kv.hotness.HitWeights``), counted here when a request finishes (its
cached prompt blocks, on its replica), on simulated time.

The record adds, per resize, the hit rate of the requests arriving in the ``window_s`` before
and after it (``after_over_before``), and per replica added, the blocks it warmed and the hit
rate of its requests in its first ``window_s`` of serving over the whole cluster's in that
window; plus a time series for plots.
"""

import random
from collections.abc import Sequence
from typing import Any, NamedTuple

from benchmarks.sim.cost_model import CostModel
from benchmarks.sim.engine import SimulatedEngine
from benchmarks.sim.simulator import DELIVER, STRATA, SimConfig, Simulator
from benchmarks.sim.trace import TraceRequest
from cluster.config import ServerConfig
from cluster.scaling import ReplicaValue, choose_victims
from replicas.config import SchedulerConfig
from replicas.engine.request import Request
from replicas.kv.events import KVSnapshot, Tier
from replicas.kv.hashing import BlockHash
from replicas.kv.hotness import HitWeights
from router.router import Router

RESIZE, RETIRE, START = 10, 11, 12
VICTIM_RULES = ("cache-aware", "random", "restart")
NODE = "node-0"  # every simulated replica runs on one node
WARM_START_BUDGET_S: float = ServerConfig.model_fields["warm_start_budget_s"].default


class Resize(NamedTuple):
    time_s: float
    num_replicas: int


class Served(NamedTuple):
    """One finished request, as the figures need it."""

    arrival_s: float
    replica: int
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float


class ResizingSimulator(Simulator):
    """A ``Simulator`` whose cluster is resized at the ``resizes``' times (module docstring)."""

    def __init__(
        self,
        config: SimConfig,
        cost_model: CostModel,
        requests: list[TraceRequest],
        resizes: Sequence[Resize],
        victim_rule: str = "cache-aware",
        window_s: float = 60.0,
    ) -> None:
        if config.policy != STRATA:
            raise ValueError("resizing needs Strata's router (policy strata)")
        if victim_rule not in VICTIM_RULES:
            raise ValueError(f"unknown victim rule {victim_rule!r}; one of {VICTIM_RULES}")
        super().__init__(config, cost_model, requests)
        self.resizes = sorted(resizes)
        self.victim_rule = victim_rule
        self.window_s = window_s
        self._rng = random.Random(config.seed)
        self._hit_capacity = sum(t.num_npu_blocks + t.num_host_blocks for t in self.cache_types)
        self.hits = [self._new_hit_weights() for _ in self.engines]
        self.serving = list(range(config.data_parallel_size))
        self.draining: set[int] = set()
        self._writes_to_disk: dict[int, bool] = {}  # per draining replica
        self.started_s = [0.0] * config.data_parallel_size  # when each began serving
        self.num_warmed: dict[int, int] = {}  # per replica added: blocks loaded from disk
        self.served: list[Served] = []
        self.resize_log: list[dict[str, Any]] = []
        self.num_interrupted = 0
        self.num_blocks_written = 0

        self.router.set_nodes([NODE] * config.data_parallel_size)

    @property
    def router(self) -> Router:
        return self.agent.router

    def _new_hit_weights(self) -> HitWeights:
        return HitWeights(self._hit_capacity, lambda: self._now)

    def run(self, progress: bool = False) -> dict[str, object]:
        for resize in self.resizes:
            self._push(resize.time_s, RESIZE, resize.num_replicas)
        record = super().run(progress)
        return {**record, **self._resize_record()}

    @property
    def label(self) -> str:
        return f"{super().label} {self.victim_rule}"

    # ---- events ------------------------------------------------------------------------------
    def _handle(self, kind: int, payload: Any, now: float) -> None:
        if kind == RESIZE:
            self._resize(payload, now)
        elif kind == RETIRE:
            self.router.retire(payload, self._last_snapshot(payload))
        elif kind == START:
            replica, ramp = payload
            if replica in self.serving:  # not removed while it warmed up
                self.started_s[replica] = now
                self.router.start_routing(replica, ramp=ramp)
        else:
            super()._handle(kind, payload, now)

    def _end_step(self, step: tuple[int, int], now: float) -> None:
        num_before = len(self._finished)
        super()._end_step(step, now)
        replica = step[0]
        for request in self._finished[num_before:]:
            self._count_served(replica, request)
        engine = self.engines[replica]
        if replica in self.draining and not engine.has_unfinished_requests():
            self._finish_drain(replica, now)

    def _count_served(self, replica: int, request: Request) -> None:
        cached = request.num_cached_tokens or 0
        self.hits[replica].hit(request.block_hashes[: cached // self.config.block_size])
        ttft = request.first_token_time - request.arrival_time
        served = Served(request.arrival_time, replica, request.num_prompt_tokens, cached, ttft)
        self.served.append(served)

    # ---- resizing ----------------------------------------------------------------------------
    def _resize(self, num_replicas: int, now: float) -> None:
        old = list(self.serving)
        entry: dict[str, Any] = {"time_s": now, "from": len(old), "to": num_replicas}
        if self.victim_rule == "restart":
            self.num_interrupted += sum(self.engines[r].num_unfinished for r in old)
            for replica in old:
                self._drain(replica, now, write_to_disk=False)
            entry["added"] = [self._add_replica(now, warm=False) for _ in range(num_replicas)]
            entry["removed"] = old
        elif num_replicas > len(old):
            entry["added"] = [self._add_replica(now) for _ in range(num_replicas - len(old))]
        elif num_replicas < len(old):
            victims = self._victims(len(old) - num_replicas)
            entry["removed"] = [r for r, _ in victims]
            entry["reasons"] = [reason for _, reason in victims]
            for replica, _ in victims:
                self._drain(replica, now, write_to_disk=True)
        self.resize_log.append(entry)

    def _victims(self, count: int) -> list[tuple[int, str]]:
        if self.victim_rule == "random":
            return [(r, "drawn at random") for r in self._rng.sample(self.serving, count)]
        load = {r.replica_index: r.load_tokens for r in self.router.stats().replicas}
        candidates = [
            ReplicaValue(r, NODE, self._hot_blocks(r), load.get(r, 0)) for r in self.serving
        ]
        choices = choose_victims(candidates, count, {NODE: self._disk_blocks()})
        return [(c.replica_index, c.reason) for c in choices]

    def _held(self, replica: int, cache_type: str) -> set[BlockHash]:
        """The blocks of ``cache_type`` the replica holds on NPU or host."""
        snapshot = self.engines[replica].kv_cache.views.snapshot(replica, 0)
        return {*snapshot.hashes(Tier.NPU, cache_type), *snapshot.hashes(Tier.HOST, cache_type)}

    def _hot_blocks(self, replica: int) -> dict[BlockHash, float]:
        """What ``ReplicaActor.hot_blocks`` reports: every held full-attention block, weighted."""
        hits = self.hits[replica]
        return {h: hits.weight(h) for h in self._held(replica, self.cache_types[0].name)}

    def _disk_blocks(self) -> set[BlockHash]:
        views = self.disk_views[0]
        if views is None:
            return set()
        return set(views[self.cache_types[0].name].disk.holders)

    def _add_replica(self, now: float, warm: bool = True) -> int:
        """Start a replica at the next unused index; ``warm``: a scale-out's (warmed from
        disk, then ramped), else a restart's (empty, serving at once)."""
        replica = len(self.engines)
        disk = None
        if self.disk_views[0] is not None:
            read_s = self.cost_model.disk_load_s(1)
            disk = {}
            for name, view in self.disk_views[0].items():
                disk[name] = view.disk.view(view.disk.add_writer(), read_s)
        self.disk_views.append(disk)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
        )
        self.engines.append(
            SimulatedEngine(
                replica,
                self._kv_cache(disk),
                scheduler_config,
                self.cost_model,
                self.max_model_len,
                disk,
            )
        )
        self.meter.add_replica()
        self._step_ids.append(0)
        self.hits.append(self._new_hit_weights())
        self.started_s.append(now)
        assert self.router.add_replica(NODE) == replica
        self.serving.append(replica)
        if not warm:
            self.router.start_routing(replica, ramp=False)
            return replica
        num_loaded, ready_s = self.engines[replica].warm_from_disk(now, WARM_START_BUDGET_S)
        self.num_warmed[replica] = num_loaded
        delay = self.config.event_delay_s
        self._push(ready_s + delay, DELIVER, self.engines[replica].publish())
        self._push(ready_s + 2 * delay, START, (replica, True))  # once the router knows them
        return replica

    def _drain(self, replica: int, now: float, write_to_disk: bool) -> None:
        self.router.set_draining(replica)
        self.serving.remove(replica)
        self.draining.add(replica)
        self._writes_to_disk[replica] = write_to_disk
        if not self.engines[replica].has_unfinished_requests():
            self._finish_drain(replica, now)

    def _finish_drain(self, replica: int, now: float) -> None:
        self.draining.discard(replica)
        if self._writes_to_disk.pop(replica) and self.disk_views[replica] is not None:
            hits = self.hits[replica]
            for name, view in self.disk_views[replica].items():
                missing = [h for h in self._held(replica, name) if not view.contains(h)]
                for block_hash in sorted(missing, key=hits.weight):  # coldest first
                    view.store(block_hash, hits.weight(block_hash))
                self.num_blocks_written += len(missing)
        # forgotten once the step reports already sent have reached the router
        self._push(now + 2 * self.config.event_delay_s, RETIRE, replica)

    def _last_snapshot(self, replica: int) -> KVSnapshot | None:
        """What the deployment hands ``Router.retire``: the replica's blocks after its
        write-out, when its disk blocks are announced at all."""
        if not self.config.announce_disk_blocks:
            return None
        return self.engines[replica].kv_cache.views.snapshot(replica, 0)

    # ---- figures -----------------------------------------------------------------------------
    def _resize_record(self) -> dict[str, object]:
        window = self.window_s
        for entry in self.resize_log:
            t = entry["time_s"]
            before = _hit_rate(s for s in self.served if t - window <= s.arrival_s < t)
            after = _hit_rate(s for s in self.served if t <= s.arrival_s < t + window)
            entry.update(
                hit_rate_before=before,
                hit_rate_after=after,
                after_over_before=after / before if before else None,
            )
        new_replicas = []
        for replica, start in enumerate(self.started_s):
            if start == 0.0:
                continue
            window_served = [s for s in self.served if start <= s.arrival_s < start + window]
            mine = [s for s in window_served if s.replica == replica]
            cluster = _hit_rate(window_served)
            new_replicas.append(
                {
                    "replica": replica,
                    "start_s": start,
                    "num_blocks_warmed": self.num_warmed.get(replica, 0),
                    "num_requests_first_window": len(mine),
                    "hit_rate_first_window": _hit_rate(mine),
                    "cluster_hit_rate": cluster,
                    "ratio": _hit_rate(mine) / cluster if mine and cluster else None,
                }
            )
        return {
            "victim_rule": self.victim_rule,
            "window_s": window,
            "resizes": self.resize_log,
            "new_replicas": new_replicas,
            "num_failed": len(self.requests) - len(self._finished),
            "num_interrupted": self.num_interrupted,
            "num_blocks_written_to_disk": self.num_blocks_written,
            "timeline": self._timeline(),
        }

    def _timeline(self, bin_s: float = 10.0) -> list[dict[str, float]]:
        """Per ``bin_s`` of arrivals: hit rate, mean TTFT and serving replicas."""
        bins: dict[int, list[Served]] = {}
        for s in self.served:
            bins.setdefault(int(s.arrival_s // bin_s), []).append(s)
        sizes = [(0.0, self.config.data_parallel_size)] + [
            (e["time_s"], e["to"]) for e in self.resize_log
        ]
        rows = []
        for b in sorted(bins):
            start = b * bin_s
            rows.append(
                {
                    "time_s": start,
                    "hit_rate": _hit_rate(bins[b]),
                    "ttft_mean_s": sum(s.ttft_s for s in bins[b]) / len(bins[b]),
                    "num_replicas": [n for t, n in sizes if t <= start][-1],
                }
            )
        return rows


def _hit_rate(served: Any) -> float:
    served = list(served)
    prompt = sum(s.num_prompt_tokens for s in served)
    return sum(s.num_cached_tokens for s in served) / prompt if prompt else 0.0
