"""The peer tier on two in-process engines: a prefix one replica computed is pulled by the
other, with the cache-off output; another model, another ``cache_salt``, a corrupt block and a
failing source are refused or missed, and the request recomputes."""

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from replicas.cache_hints import CacheHints, PeerSource
from replicas.config import EngineConfig, KVOffloadConfig, PrefixCacheConfig, SchedulerConfig
from replicas.engine.engine import Engine
from replicas.kv.tiers import peer
from tests.tier_registry import restored_tier_registry
from tests.unit.engine_runs import GREEDY, run

PROMPT = [(11 * i + 5) % 200 for i in range(16 * 8)] + [1, 2, 3]  # 8 full blocks and a tail
NUM_BLOCKS = 8


def engine(seed: int = 0, **offload) -> Engine:
    return Engine(
        EngineConfig(
            model="tiny",
            seed=seed,
            num_npu_blocks=48,
            scheduler_config=SchedulerConfig(
                kv_offload_config=KVOffloadConfig(enabled=True, host_memory_ratio=1.0, **offload)
            ),
        )
    )


@pytest.fixture(scope="module", autouse=True)
def peer_registered() -> Iterator[None]:
    """The configs below register the peer tier; the registry is as before after the module."""
    with restored_tier_registry():
        yield


@pytest.fixture(scope="module")
def cold_tokens() -> list[int]:
    cold = Engine(
        EngineConfig(
            model="tiny",
            scheduler_config=SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False)),
        )
    )
    return run(cold, PROMPT).token_ids


@pytest.fixture(scope="module")
def source() -> Engine:
    """A replica that served the prompt: its blocks are on its NPU tier."""
    holder = engine()
    run(holder, PROMPT)
    return holder


def pull(puller: Engine, handle, request_id: str, salt: str | None = None):
    hints = CacheHints(peer=PeerSource(1, handle, NUM_BLOCKS * 16))
    puller.add_request(request_id, PROMPT, GREEDY, cache_hints=hints, cache_salt=salt)
    outputs = []
    while puller.has_unfinished_requests():
        outputs = puller.step() or outputs
    puller.check_integrity()
    return outputs[-1]


def test_a_replica_pulls_a_peers_prefix_instead_of_computing_it(source, cold_tokens):
    puller = engine(tiers={"peer": {}})
    output = pull(puller, peer.LocalPeer(source), "r")
    assert output.token_ids == cold_tokens
    assert output.num_cached_tokens == NUM_BLOCKS * 16  # loaded from host after the pull
    stats = puller.stats()
    assert stats.cache.peer_blocks_loaded == NUM_BLOCKS and stats.cache.peer_reloads == 1
    assert stats.cache.hits_by_tier()["peer"] == NUM_BLOCKS * 16
    assert stats.backing["peer"]["full"].blocks_pulled == NUM_BLOCKS
    again = pull(puller, peer.LocalPeer(source), "again")  # now its own host blocks
    assert again.token_ids == cold_tokens and puller.stats().cache.peer_blocks_loaded == NUM_BLOCKS
    puller.close()


def test_a_fan_out_burst_pulls_the_prefix_once_for_all_its_branches(source, cold_tokens):
    puller = engine(tiers={"peer": {}})
    hints = CacheHints(peer=PeerSource(1, peer.LocalPeer(source), NUM_BLOCKS * 16))
    for i in range(4):  # branches of one prefix, arriving together
        puller.add_request(f"b{i}", PROMPT[:-3] + [i, 9, 9], GREEDY, cache_hints=hints)
    finished = {}
    for _ in range(10_000):
        if not puller.has_unfinished_requests():
            break
        finished |= {o.request_id: o for o in puller.step() if o.finished}
    puller.check_integrity()
    assert all(o.num_cached_tokens == NUM_BLOCKS * 16 for o in finished.values())
    stats = puller.stats()
    assert stats.backing["peer"]["full"].blocks_pulled == stats.cache.peer_blocks_loaded
    assert stats.cache.peer_blocks_loaded == NUM_BLOCKS  # once, not once per branch
    puller.close()


class Corrupting(peer.LocalPeer):
    def export_blocks(self, cache_type, hashes):
        fingerprint, blocks = super().export_blocks(cache_type, hashes)
        bad = blocks[0]
        return fingerprint, [bad._replace(checksum=bad.checksum ^ 1), *blocks[1:]]


class Slow(peer.LocalPeer):
    def export_blocks(self, cache_type, hashes):
        time.sleep(0.05)
        return super().export_blocks(cache_type, hashes)


class Failing(peer.LocalPeer):
    def export_blocks(self, cache_type, hashes):
        raise ConnectionError("the source died")

    def export_probe(self, cache_type, num_blocks):
        raise ConnectionError("the source died")


@pytest.mark.parametrize("case", ["other model", "other salt", "corrupt", "dead source"])
def test_a_refused_or_failed_pull_recomputes_with_the_right_output(source, cold_tokens, case):
    puller = engine(seed=1 if case == "other model" else 0, tiers={"peer": {}})
    handle = {"corrupt": Corrupting, "dead source": Failing}.get(case, peer.LocalPeer)(source)
    other_model = case == "other model"
    expected = run(engine(seed=1), PROMPT).token_ids if other_model else cold_tokens
    salt = "tenant-b" if case == "other salt" else None
    output = pull(puller, handle, "r", salt)
    assert output.token_ids == expected
    stats = puller.stats()
    pulled = 0 if case != "corrupt" else NUM_BLOCKS - 1  # the rest of the prefix is useless
    assert stats.backing["peer"]["full"].pull_failures >= 1
    assert output.num_cached_tokens == 0 or case == "corrupt"
    assert stats.cache.peer_blocks_loaded == pulled
    puller.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_block_travels_as_its_bytes_and_lands_whole_or_not_at_all(dtype):
    hashes = [b"a" * 16, b"b" * 16]
    block = (torch.arange(96) - 40).reshape(2, 3, 16).to(dtype)
    _, (sent, missing) = peer.export("fingerprint", [block, None], hashes)
    assert missing is None and sent.data.dtype == np.uint8  # numpy: no pickled tensor
    out = torch.zeros(2, 3, 16, dtype=dtype)
    assert peer.PeerStore._accept(sent, hashes[0], out) and torch.equal(out, block)
    strided = torch.zeros(3, 2, 16, dtype=dtype).transpose(0, 1)  # not contiguous
    assert peer.PeerStore._accept(sent, hashes[0], strided) and torch.equal(strided, block)
    assert not peer.PeerStore._accept(sent, hashes[1], out)  # another hash than asked
    assert not peer.PeerStore._accept(sent, hashes[0], torch.zeros(2, 3, 8, dtype=dtype))


def test_the_peer_tier_takes_no_budget_and_needs_the_host_tier():
    config = KVOffloadConfig(enabled=True, host_memory_ratio=1.0, tiers={"peer": {}})
    assert config.backing_options()["peer"].bytes is None
    with pytest.raises(ValueError, match=r"tiers\['peer'\] needs the host tier"):
        KVOffloadConfig(tiers={"peer": {}})
    with pytest.raises(ValueError, match=r"tiers\['peer'\].timeout_s"):
        KVOffloadConfig(enabled=True, host_memory_ratio=1.0, tiers={"peer": {"timeout_s": 0}})


def test_a_burst_sharing_the_prefix_pulls_it_once(source, cold_tokens):
    puller = engine(tiers={"peer": {}})
    hints = CacheHints(peer=PeerSource(1, peer.LocalPeer(source), NUM_BLOCKS * 16))
    for i in range(3):  # the router names the source for the first; the rest follow it there
        puller.add_request(f"b{i}", PROMPT, GREEDY, cache_hints=hints if i == 0 else None)
    outputs = {}
    while puller.has_unfinished_requests():
        outputs.update({o.request_id: o for o in puller.step()})
    puller.check_integrity()
    assert all(o.token_ids == cold_tokens for o in outputs.values()) and len(outputs) == 3
    assert all(o.num_cached_tokens == NUM_BLOCKS * 16 for o in outputs.values())
    assert puller.stats().backing["peer"]["full"].blocks_pulled == NUM_BLOCKS  # once
    puller.close()


def test_offers_expire_oldest_first_and_a_renewed_one_stays(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(peer.time, "monotonic", lambda: now[0])
    store = peer.PeerStore("full", "fingerprint", timeout_s=1.0, block_bytes=64)
    source = PeerSource(0, None, 64)
    store.offer([b"a", b"b"], source)
    now[0] += peer.OFFER_TTL_S / 2
    store.offer([b"a", b"c"], source)  # renewed: now the newest
    now[0] += peer.OFFER_TTL_S / 2 + 1
    store.expire()
    assert (store.contains(b"a"), store.contains(b"b"), store.contains(b"c")) == (True, False, True)
    assert store.read_seconds_per_block() == 64 * peer.DEFAULT_READ_S_PER_BYTE  # none measured
    store.close()


def test_metrics_show_the_peer_tier_and_the_cost_rule(source):
    from cluster.backend import ClusterStats, ReplicaStats
    from cluster.metrics import cluster_metric_families

    puller = engine(tiers={"peer": {}})
    pull(puller, peer.LocalPeer(source), "m")
    replica = ReplicaStats(0, True, puller.stats())
    families = {f.name: f for f in cluster_metric_families(ClusterStats([replica]))}
    samples = {
        tuple(s.labels.values()): s.value for s in families["strata_kv_backing_tier"].samples
    }
    assert samples[("0", "peer", "blocks_loaded")] == NUM_BLOCKS
    costs = {s.labels["cost"] for s in families["strata_kv_reload_rule_seconds_per_block"].samples}
    assert {"recompute", "host_load", "peer_read"} <= costs
    puller.close()


def test_a_replica_reports_its_pull_costs_at_start_and_when_its_pulls_move_them(source):
    from replicas.pull_costs import REPORT_INTERVAL_S, PullCostReport
    from replicas.step_costs import StepCosts

    puller = engine(tiers={"peer": {}})
    step = StepCosts(0.0, 1e-4, 0.0, 0.0, 0.0, 2e-5, 0.0, 64, 0.0, 0.0)
    now = [0.0]
    sent = []
    report = PullCostReport(puller, 0, step, sent.append, clock=lambda: now[0])
    report.maybe_send()
    assumed = puller.backing["peer"]["full"].read_seconds_per_block()
    assert len(sent) == 1 and sent[0].read_s_per_block == assumed  # 1 GB/s before a pull
    assert sent[0].break_even_blocks() == 1 and sent[0].block_size == 16
    pull(puller, Slow(source), "m")  # measures a read far slower than assumed
    report.maybe_send()
    assert len(sent) == 1  # looked at again only after the interval
    now[0] += REPORT_INTERVAL_S
    report.maybe_send()
    measured = puller.backing["peer"]["full"].read_seconds_per_block()
    assert measured > 2 * assumed and sent[-1].read_s_per_block == measured
    now[0] += REPORT_INTERVAL_S
    report.maybe_send()
    assert sent[-1] is sent[1] and len(sent) == 2  # unchanged: not sent again
    puller.close()


class ClockedProbes(peer.LocalPeer):
    """Answers probes 20 ms + 1 ms a block later on a fake clock."""

    def __init__(self, engine: Engine, now: list[float]) -> None:
        super().__init__(engine)
        self.now = now

    def export_probe(self, cache_type, num_blocks):
        self.now[0] += 0.020 + 0.001 * num_blocks
        return super().export_probe(cache_type, num_blocks)


def test_a_probe_prices_the_first_pull_with_a_measured_round_trip(source, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(peer.time, "perf_counter", lambda: now[0])
    puller = engine(tiers={"peer": {}})
    store = puller.backing["peer"]["full"]
    assumed = store.read_seconds_per_block()
    assert store.probe(ClockedProbes(source, now))
    assert store.read_seconds_fixed() == pytest.approx(0.020)
    assert store.read_seconds_per_block() == pytest.approx(0.001) != assumed
    assert puller.stats().backing["peer"]["full"].round_trip_s == pytest.approx(0.020)
    assert puller.stats().backing["peer"]["full"].blocks_pulled == 0  # probes are not pulls
    assert puller.stats().backing["peer"]["full"].timed_pulls == 2  # the quickest of each size
    costs = puller.kv_cache.onboarding.reload_costs()
    assert costs.read_fixed_s["peer"] == pytest.approx(0.020)
    puller.close()


@pytest.mark.parametrize("case", ["other model", "dead source"])
def test_a_probe_that_fails_leaves_the_assumed_costs(source, case):
    puller = engine(seed=1 if case == "other model" else 0, tiers={"peer": {}})
    store = puller.backing["peer"]["full"]
    before = (store.read_seconds_fixed(), store.read_seconds_per_block())
    handle = Failing(source) if case == "dead source" else peer.LocalPeer(source)
    assert not store.probe(handle)
    assert (store.read_seconds_fixed(), store.read_seconds_per_block()) == before
    puller.close()
