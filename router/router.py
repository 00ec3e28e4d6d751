"""The router: picks a data-parallel replica for each request and keeps its view of the replicas
(cached prefixes, load, liveness) up to date. Plain class; ``router.actor`` wraps it for Ray."""

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum

from replicas.kv.events import KVEventBatch, KVSnapshot, Tier, tier_count
from replicas.kv.hashing import BlockHash
from replicas.step_costs import PullCosts
from router.affinity import KeyAffinity
from router.config import RoutingConfig, TTFTCosts
from router.load import LoadTracker
from router.peer_sources import PeerSources
from router.policies import ReplicaQueues, RouteDecision, make_policy
from router.prefix_index import IndexMatch
from router.replica_caches import ReplicaCaches
from router.stats import ReplicaRoutingStats, RouterStats, RoutingCounters


class NoLiveReplicaError(RuntimeError):
    """No replica is live: raised by ``Router.route`` when every replica is marked dead, and by
    the cluster backends (HTTP 503)."""


class ReplicaRole(StrEnum):
    """Where a replica is in the life of a resizable deployment (``cluster.scaling``)::

        joining ──start_routing──▶ serving ──set_draining──▶ draining ──retire──▶ retired

    Joining and draining replicas are indexed and credited but not routed to; a retired one is
    forgotten for good (its index number is never reused)."""

    JOINING = "joining"
    SERVING = "serving"
    DRAINING = "draining"
    RETIRED = "retired"


@dataclass(slots=True)
class _ReplicaSync:
    """Liveness, role and event position of one replica."""

    is_live: bool = True
    next_seq: int = 0
    """Sequence number of the next event the index expects from the replica."""
    needs_resync: bool = False
    role: ReplicaRole = ReplicaRole.SERVING
    ramp_start_s: float | None = None
    """When a replica added by a scale-out started serving, while its ramp lasts."""

    @property
    def is_routable(self) -> bool:
        return self.is_live and self.role == ReplicaRole.SERVING


class Router:
    """Routes requests (score → choose → charge) and follows each replica's KV events.

    Event stream of one replica, against the index's position ``next_seq``::

        events applied: 0 .. next_seq-1 | expected: next_seq ...
        batch wholly before next_seq            -> stale: ignored, returns True
        batch starting at or before next_seq    -> its unseen tail is applied, returns True
        batch starting after next_seq (a gap)   -> replica needs resync: returns False, and every
                                                   batch is ignored until resync(snapshot), after
                                                   which events continue from snapshot.next_seq

    What each replica has cached, indexed and pending, and the prefix a prompt matches there
    are its ``ReplicaCaches``' (``router.replica_caches``).

    A replica awaiting resync is still routed to, on its last known (possibly stale) index. A dead
    replica is neither routed to nor indexed; its index and load are dropped at once, and its
    requests' later completion or abort releases nothing. Not thread-safe: the actor serialises
    calls.

    Resizing (``ReplicaRole``): ``add_replica`` grows every per-replica structure by one joining
    replica, ``start_routing`` lets it take requests, ``set_draining`` stops routing to one and
    ``retire`` forgets it. A replica that starts serving by a scale-out ramps up: for a cold
    prompt (cached on no routable replica) it is scored as carrying, on top of its own load, the
    busiest other replica's load plus the prompt, times the share of ``ramp_s`` still to run,
    so it takes a growing share of new prefixes rather than every one at once; prompts it
    caches reach it as usual.
    """

    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        config: RoutingConfig,
        sliding_window: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_replicas <= 0:
            raise ValueError(f"num_replicas must be positive, got {num_replicas}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.config = config
        self.sliding_window = sliding_window
        self._clock = clock
        # Without its cost profile the ttft policy waits for set_ttft_costs (a deployment
        # measures the profile on its replicas before it serves).
        self._policy = None if config.needs_ttft_costs else make_policy(config, block_size)
        self._caches = ReplicaCaches(num_replicas, block_size, sliding_window)
        self._affinity = KeyAffinity(config.max_cache_keys)
        self._load = LoadTracker(num_replicas)
        self._sync = [_ReplicaSync() for _ in range(num_replicas)]
        self._counters = [RoutingCounters() for _ in range(num_replicas)]
        self._live: list[int] = list(range(num_replicas))  # routable, ascending; see _relist
        self._peers = PeerSources(config.peer_pull_min_blocks, block_size, self._caches, self._load)

    def set_ttft_costs(self, costs: TTFTCosts) -> None:
        """Price the ttft profile with ``costs`` from now on (the profile a deployment measured
        at start-up), in place of any it had."""
        if self.config.scoring_profile != "ttft":
            raise ValueError(
                f"set_ttft_costs needs the ttft scoring profile, not {self.config.scoring_profile}"
            )
        self.config = self.config.model_copy(update={"ttft_costs": costs})
        self._policy = make_policy(self.config, self.block_size)

    def set_pull_costs(self, replica: int, costs: PullCosts) -> None:
        """What pulling a prefix from a peer costs ``replica`` (``router.peer_sources``)."""
        self._peers.set_costs(replica, costs)

    def route(
        self,
        request_id: str,
        num_prompt_tokens: int,
        block_hashes: Sequence[BlockHash],
        exclude: Collection[int] = (),
        cache_key: str | None = None,
    ) -> RouteDecision:
        """Pick a live replica for a new request and charge its prompt tokens there (mutates).

        ``block_hashes`` are the prompt's full-block hashes; replicas in ``exclude`` (those that
        turned the request away) are not candidates. Requests with one ``cache_key`` (the API's
        ``prompt_cache_key``) go to the replica that served the key last while it is not
        overloaded (``router.affinity``); the key then follows the chosen replica. Raises
        NoLiveReplicaError when no live replica is left, ValueError when ``request_id`` is
        already routed and not released.
        """
        live = [r for r in self._live if r not in exclude] if exclude else self._live
        if not live:
            raise NoLiveReplicaError(
                f"no live replica among {self.num_replicas} to route to"
                + (f" but {sorted(exclude)}, which turned the request away" if exclude else "")
            )
        if self._policy is None:
            raise RuntimeError("the router's ttft profile has no cost profile yet")
        load = self._load
        matches = self._caches.match(block_hashes, self._live)  # score
        peers = self._peers.min_blocks and self.config.enable_prefix_caching and len(live) > 1
        scored = self._peers.scored_matches(block_hashes, matches, self._live) if peers else matches
        queues = ReplicaQueues(load.queued_tokens, load.num_requests)
        key_replica = self._affinity.replica_of(cache_key)
        if key_replica not in live:
            key_replica = None
        load_tokens = load.load_tokens
        if key_replica is None:
            load_tokens = self._ramped_load(live, matches, num_prompt_tokens)
        decision = self._policy.choose(
            live, scored, load_tokens, num_prompt_tokens, queues, key_replica
        )
        self._affinity.record(cache_key, decision.replica_index)
        uncached = num_prompt_tokens - decision.num_matched_tokens
        load.charge(request_id, decision.replica_index, num_prompt_tokens, uncached)  # charge
        if self.config.enable_prefix_caching:
            self._caches.add_pending(request_id, decision.replica_index, block_hashes)
        counters = self._counters[decision.replica_index]
        counters.record_route(decision.num_matched_tokens_by_tier, num_prompt_tokens)
        counters.num_key_affinity_routes += int(decision.is_key_affinity)
        counters.num_overload_diversions += int(decision.is_overload_diversion)
        if self._peers.min_blocks and self.config.enable_prefix_caching and len(self._live) > 1:
            decision, priced_out = self._peers.with_source(
                decision, block_hashes, matches, self._live
            )
            counters.num_peer_sources += int(decision.peer_source is not None)
            counters.num_peer_priced_out += int(priced_out)
        return decision

    def _ramped_load(
        self, live: Sequence[int], matches: Sequence[IndexMatch], num_prompt_tokens: int
    ) -> Sequence[int]:
        """The loads the policy scores a prompt with: with a cold prompt and a replica still
        ramping up, that replica's load plus its ramp penalty (see the class docstring)."""
        load_tokens = self._load.load_tokens
        ramping = [r for r in live if self._sync[r].ramp_start_s is not None]
        if not ramping or any(matches[r].num_blocks for r in live):
            return load_tokens
        now = self._clock()
        ramp_s = self.config.ramp_s
        busiest = max((load_tokens[r] for r in live if r not in ramping), default=0)
        ramped = list(load_tokens)
        for replica in ramping:
            sync = self._sync[replica]
            remaining = 1.0 - (now - sync.ramp_start_s) / ramp_s if ramp_s > 0 else 0.0
            if remaining <= 0:
                sync.ramp_start_s = None  # ramped up
                continue
            ramped[replica] += int(remaining * (busiest + num_prompt_tokens))
        return ramped

    def add_generated(self, request_id: str, num_tokens: int) -> None:
        """Charge newly generated tokens to the request's replica; no-op once released. Its
        prompt is no longer pending: the report carrying its first token carried its prompt
        blocks' KV events too."""
        self._load.add_generated(request_id, num_tokens)
        self._caches.remove_pending(request_id)

    def release(self, request_id: str) -> None:
        """Release the request's load (and pending prompt) at completion or abort; idempotent."""
        self._load.release(request_id)
        self._caches.remove_pending(request_id)

    def on_events(self, batch: KVEventBatch) -> bool:
        """Apply a replica's KV event batch in order (mutates; see the class docstring).

        Returns True when the index is in step with the batch (applied, or stale and ignored),
        False when it was not applied: a gap (the replica now needs resync), a resync already
        pending, or a dead replica.
        """
        if batch.replica_index >= self.num_replicas:  # added meanwhile; told of it later
            return False
        sync = self._replica_sync(batch.replica_index)
        if not sync.is_live or sync.needs_resync:
            return False
        if batch.first_seq > sync.next_seq:
            sync.needs_resync = True
            self._counters[batch.replica_index].num_event_gaps += 1
            return False
        if batch.next_seq <= sync.next_seq:
            return True
        num_seen = sync.next_seq - batch.first_seq
        if num_seen:
            batch = batch._replace(first_seq=sync.next_seq, events=batch.events[num_seen:])
        self._caches.apply(batch)
        sync.next_seq = batch.next_seq
        return True

    def needs_resync(self) -> list[int]:
        """Live replicas whose index missed events and awaits a snapshot, ascending."""
        return [i for i, sync in enumerate(self._sync) if sync.is_live and sync.needs_resync]

    def request_resync(self, replica: int) -> None:
        """Mark a live replica's index as untrusted (mutates): its events are ignored until
        ``resync(snapshot)``, e.g. after the router itself restarted with an empty index."""
        sync = self._replica_sync(replica)
        if sync.is_live:
            sync.needs_resync = True

    def resync(self, snapshot: KVSnapshot) -> bool:
        """Replace the replica's index by ``snapshot`` and expect events from its ``next_seq``
        (mutates). Ignored (returns False) for a dead replica, and for a replica in step whose
        index is already past the snapshot."""
        replica = snapshot.replica_index
        sync = self._replica_sync(replica)
        if not sync.is_live or (not sync.needs_resync and snapshot.next_seq < sync.next_seq):
            return False
        self._caches.load_snapshot(snapshot)
        sync.next_seq = snapshot.next_seq
        sync.needs_resync = False
        self._counters[replica].num_resyncs += 1
        return True

    def mark_dead(self, replica: int) -> None:
        """Stop routing to ``replica`` and drop its index and load (mutates; idempotent)."""
        sync = self._replica_sync(replica)
        sync.is_live = False
        sync.needs_resync = False
        self._caches.clear_replica(replica, with_node_tiers=False)
        self._load.clear_replica(replica)
        self._affinity.clear_replica(replica)
        self._relist()

    def mark_alive(self, replica: int, next_seq: int = 0) -> None:
        """(Re)join ``replica`` as a fresh process (mutates): empty index and no load, expecting
        events from ``next_seq``. On a live replica this resets it the same way (a restart).
        Its role stays; a retired replica stays out (returns without a change)."""
        sync = self._replica_sync(replica)
        if sync.role == ReplicaRole.RETIRED:
            return
        # its blocks in node-shared tiers too: a fresh process announces them again
        self._caches.clear_replica(replica, with_node_tiers=True)
        self._load.clear_replica(replica)
        sync.is_live = True
        sync.next_seq = next_seq
        sync.needs_resync = False
        self._relist()

    # ---- resizing ----------------------------------------------------------------------------
    def add_replica(self, node_id: str | None = None) -> int:
        """Grow every per-replica structure by one joining replica on node ``node_id`` (its
        events are indexed, its node's disk blocks credited, but nothing is routed to it until
        ``start_routing``); its index, the next unused one (mutates)."""
        replica = self.num_replicas
        self._caches.add_replica(node_id)
        self._load.add_replica()
        self._sync.append(_ReplicaSync(role=ReplicaRole.JOINING))
        self._counters.append(RoutingCounters())
        self.num_replicas += 1
        return replica

    def start_routing(self, replica: int, ramp: bool = True) -> None:
        """Route to a joining (or draining) replica from now on (mutates); with ``ramp``, its
        share of cold prompts ramps up over ``config.ramp_s``."""
        sync = self._replica_sync(replica)
        if sync.role == ReplicaRole.RETIRED:
            raise ValueError(f"replica {replica} is retired")
        sync.role = ReplicaRole.SERVING
        sync.ramp_start_s = self._clock() if ramp and self.config.ramp_s > 0 else None
        self._relist()

    def set_draining(self, replica: int) -> None:
        """Stop routing new requests to ``replica`` (mutates); its index and load stay until
        ``retire`` (its running requests still report)."""
        sync = self._replica_sync(replica)
        if sync.role == ReplicaRole.RETIRED:
            raise ValueError(f"replica {replica} is retired")
        sync.role = ReplicaRole.DRAINING
        sync.ramp_start_s = None
        self._relist()

    def retire(self, replica: int, snapshot: KVSnapshot | None = None) -> None:
        """Forget ``replica`` for good (mutates; idempotent): as ``mark_dead``, and it never
        rejoins. Its blocks in node-shared tiers (disk) stay credited to its node (its slab stays
        readable): those of ``snapshot`` when given (its last one, taken after it wrote its hot
        blocks to disk)."""
        if snapshot is not None and self._sync[replica].role != ReplicaRole.RETIRED:
            self._caches.load_node_snapshot(snapshot)
        self.mark_dead(replica)
        self._sync[replica].role = ReplicaRole.RETIRED
        self._peers.forget(replica)
        self._relist()

    def roles(self) -> list[ReplicaRole]:
        """Every replica's role, by replica index (retired ones included)."""
        return [sync.role for sync in self._sync]

    def sync_members(self, roles: Sequence[str], node_ids: Sequence[str]) -> None:
        """Take the deployment's view of its replicas (mutates): grow to ``len(roles)`` and
        give each its role, e.g. after a restart re-created this router at its start-up size.
        A replica's index and load are kept unless it is retired."""
        if len(node_ids) != len(roles):
            raise ValueError(f"{len(node_ids)} node ids for {len(roles)} replicas")
        while self.num_replicas < len(roles):
            self.add_replica()
        for replica, role in enumerate(roles):
            role = ReplicaRole(role)
            if role == ReplicaRole.RETIRED:
                self.retire(replica)
            elif role == ReplicaRole.SERVING:
                if self._sync[replica].role != ReplicaRole.SERVING:
                    self.start_routing(replica, ramp=False)
            elif role == ReplicaRole.DRAINING:
                self.set_draining(replica)
            else:
                self._sync[replica].role = role
        self._relist()
        self.set_nodes(node_ids)

    def _relist(self) -> None:
        self._live = [i for i, s in enumerate(self._sync) if s.is_routable]

    def set_nodes(self, node_ids: Sequence[str]) -> None:
        """Which node each replica runs on: replicas of one node share its disk tier."""
        self._caches.set_nodes(node_ids)

    def live_replicas(self) -> list[int]:
        """Indices of the replicas routed to, ascending."""
        return list(self._live)

    def stats(self) -> RouterStats:
        """A consistent copy of every replica's counters, load and index size (retired
        replicas left out)."""
        replicas = []
        for i, (sync, counters) in enumerate(zip(self._sync, self._counters)):
            if sync.role == ReplicaRole.RETIRED:
                continue
            buckets = counters.cumulative_bucket_counts()
            replicas.append(
                ReplicaRoutingStats(
                    replica_index=i,
                    is_live=sync.is_live,
                    needs_resync=sync.needs_resync,
                    num_requests_routed=counters.num_requests_routed,
                    num_matched_tokens=counters.num_matched_tokens,
                    num_matched_tokens_by_tier=tuple(counters.num_matched_tokens_by_tier),
                    matched_fraction_sum=counters.matched_fraction_sum,
                    matched_fraction_count=buckets[-1],
                    matched_fraction_bucket_counts=buckets,
                    load_tokens=self._load.load_tokens[i],
                    num_indexed_blocks_by_tier=self._caches.num_blocks_by_tier(i),
                    num_event_gaps=counters.num_event_gaps,
                    num_resyncs=counters.num_resyncs,
                    num_key_affinity_routes=counters.num_key_affinity_routes,
                    num_peer_sources=counters.num_peer_sources,
                    num_peer_priced_out=counters.num_peer_priced_out,
                    num_overload_diversions=counters.num_overload_diversions,
                    peer_break_even_blocks=self._peers.break_even_blocks(i),
                    queued_tokens=self._load.queued_tokens[i],
                    num_requests=self._load.num_requests[i],
                    role=sync.role.value,
                )
            )
        return RouterStats(replicas=tuple(replicas), num_indexed_hashes=len(self._caches))

    def check_integrity(self) -> None:
        """Raise AssertionError unless the index, the loads and the live list agree."""
        self._caches.check_integrity()
        self._load.check_integrity()
        assert self._caches.num_pending <= len(self._load), "a pending prompt outlived its charge"
        assert self._live == [i for i, s in enumerate(self._sync) if s.is_routable], "stale list"
        for i, sync in enumerate(self._sync):
            if not sync.is_live:
                num_blocks = self._caches.num_blocks_by_tier(i)
                assert not tier_count(num_blocks, Tier.NPU), f"dead replica {i} still indexed"
                assert not tier_count(num_blocks, Tier.HOST), f"dead replica {i} still indexed"
                assert self._load.load_tokens[i] == 0, f"dead replica {i} still carries load"

    def _replica_sync(self, replica: int) -> _ReplicaSync:
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica index {replica} out of range 0..{self.num_replicas - 1}")
        return self._sync[replica]
