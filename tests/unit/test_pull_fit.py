"""A pull's cost in two parts, a round trip per call and a copy per block (``PullFit``), in the
peer store, the replica's cost rule and the router's price."""

import pytest
import torch

from replicas.cache_hints import PeerSource
from replicas.kv.onboarding import read_seconds_fixed
from replicas.kv.tiers import peer
from replicas.kv.tiers.pull_fit import PullFit
from replicas.step_costs import PullCosts


def test_two_sizes_of_pull_separate_the_round_trip_from_the_copies():
    fit = PullFit(0.0, 1e-3)
    assert fit.parts() == (0.0, 1e-3) and fit.num_pulls == 0  # the prior
    for num_blocks in (4, 64, 4, 64):
        fit.add(num_blocks, 0.050 + 0.002 * num_blocks)
    fixed, per_block = fit.parts()
    assert fixed == pytest.approx(0.050) and per_block == pytest.approx(0.002)
    assert fit.seconds(256) == pytest.approx(0.050 + 0.512)
    # The mean per block would price a 256-block pull at (0.058 + 0.178) / 68 x 256 = 0.89 s.


def test_one_size_keeps_the_priors_round_trip_and_odd_fits_are_bounded():
    same = PullFit(0.005, 1e-3)
    same.add(10, 0.1)
    assert same.parts() == pytest.approx((0.005, 0.0095))
    tiny = PullFit(0.5, 1e-3)
    tiny.add(10, 0.1)
    assert tiny.parts() == pytest.approx((0.1, 0.0))  # the round trip at most the whole pull
    flat = PullFit(0.0, 1e-3)
    flat.add(2, 0.3)
    flat.add(20, 0.1)  # bigger and faster: all of it counts as the round trip
    assert flat.parts() == pytest.approx((0.2, 0.0))
    steep = PullFit(0.0, 1e-3)
    steep.add(2, 0.001)
    steep.add(20, 0.1)  # the line would cross below 0 seconds: through the origin instead
    fixed, per_block = steep.parts()
    assert fixed == 0.0 and per_block == pytest.approx((2 * 0.001 + 20 * 0.1) / (4 + 400))
    ignored = PullFit(0.0, 1e-3)
    ignored.add(0, 1.0)
    ignored.add(3, float("nan"))
    assert ignored.num_pulls == 0


class ClockedSource(peer.LocalPeer):
    """A source answering ``fixed_s + n x per_block_s`` later on a fake clock."""

    def __init__(self, now: list[float], fixed_s: float, per_block_s: float) -> None:
        super().__init__(None)
        self.now, self.fixed_s, self.per_block_s = now, fixed_s, per_block_s

    def export_blocks(self, cache_type, hashes):
        self.now[0] += self.fixed_s + self.per_block_s * len(hashes)
        blocks = [torch.full((16,), float(i)) for i in range(len(hashes))]
        return peer.export("fp", blocks, hashes)


def test_the_peer_store_fits_its_pulls_per_call(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(peer.time, "perf_counter", lambda: now[0])
    store = peer.PeerStore("full", "fp", timeout_s=1.0, block_bytes=64)
    assert store.read_seconds_fixed() == 0.0  # before a pull: 1 GB/s, no round trip
    assert store.read_seconds_per_block() == 64 * peer.DEFAULT_READ_S_PER_BYTE
    source = PeerSource(0, ClockedSource(now, 0.030, 0.001), 64)
    for size in (2, 20):
        hashes = [bytes([size, i]) * 8 for i in range(size)]
        store.offer(hashes, source)
        outs = [torch.zeros(16) for _ in hashes]
        assert all(store.load_many(hashes, outs).result())
    assert store.read_seconds_fixed() == pytest.approx(0.030)
    assert store.read_seconds_per_block() == pytest.approx(0.001)
    assert read_seconds_fixed(store) == pytest.approx(0.030)
    assert read_seconds_fixed(object()) == 0.0  # a store without a round trip
    store.close()


def test_the_round_trip_counts_once_per_pull_in_the_router_price():
    # 1 ms a token to compute (16 ms a block); a pull: 100 ms, then 1 ms a block.
    costs = PullCosts(1e-3, 0.0, 1e-3, 0.0, 2048, 16, read_s_fixed=0.1)
    assert costs.pull_s(4, 0.0) == pytest.approx(0.104)
    assert not costs.pays(4, 0, 0.0)  # 104 ms against 64 ms
    assert costs.pays(64, 0, 0.0)  # 164 ms against 1.02 s
    assert costs.break_even_blocks() == 7  # 0.1 / (0.016 - 0.001) = 6.7
    assert costs.break_even_blocks(wait_s=0.05) == 11
