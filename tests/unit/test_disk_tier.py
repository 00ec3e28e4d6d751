"""The disk tier on the real engine: restarts, corrupt and missing files, other models, two
replicas on one directory, capacity, the cost rule, a failing disk and a hung one."""

import logging
import os
import random
import time

import pytest

from cluster import KVOffloadConfig, PrefixCacheConfig, SchedulerConfig
from cluster.cli import build_config, build_parser
from replicas.config import EngineConfig
from replicas.engine.engine import Engine
from replicas.kv import disk as kv_disk
from replicas.kv import onboarding
from replicas.kv.events import KVEventBatch, KVEventKind, Tier
from replicas.kv.hashing import block_hashes
from replicas.kv.onboarding import reload_pays
from replicas.kv.retention import BlockCosts
from router.config import RoutingConfig
from router.router import Router
from tests.unit.engine_runs import GREEDY, run

PREFIX_BLOCKS = 12


def prompt_pair(seed: int) -> tuple[list[int], list[int]]:
    """A 192-token prefix (12 blocks) with two different tails."""
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(16 * PREFIX_BLOCKS)]
    return [*prefix, 7, 8, 9], [*prefix, 3, 4]


def engine(disk_path, *, disk_blocks: int = 256, seed: int = 0, block_size: int = 16, **kw):
    offload = KVOffloadConfig(
        enabled=True,
        host_memory_ratio=2.0,
        write_through_threshold=kw.pop("write_through_threshold", "immediate"),
        disk_path=str(disk_path),
        disk_bytes=disk_blocks * 4 * 2 * block_size * 2 * 64 * 4,  # tiny: 64 KiB per block at 16
        **kw,
    )
    return Engine(
        EngineConfig(
            model="tiny",
            seed=seed,
            block_size=block_size,
            num_npu_blocks=48,
            scheduler_config=SchedulerConfig(kv_offload_config=offload),
        )
    )


@pytest.fixture(scope="module")
def cold() -> Engine:
    """The reference: the same model with caching off."""
    return Engine(
        EngineConfig(
            model="tiny",
            scheduler_config=SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False)),
        )
    )


def warm_disk(path, prompt: list[int], **kw) -> None:
    """Serve ``prompt`` once on a fresh engine over ``path``, then shut it down."""
    first = engine(path, **kw)
    run(first, prompt)
    first.close()
    assert first.backing["disk"]["full"].stats().num_cached >= PREFIX_BLOCKS


def test_a_restarted_engine_serves_the_prefix_from_disk_with_cold_output(tmp_path, cold):
    seen, prompt = prompt_pair(1)
    warm_disk(tmp_path, seen)
    restarted = engine(tmp_path)
    output = run(restarted, prompt)
    assert output.token_ids == run(cold, prompt).token_ids
    assert output.num_cached_tokens_in(Tier.HOST) == output.num_cached_tokens == 16 * PREFIX_BLOCKS
    stats = restarted.stats().cache
    assert stats.disk_hits == 16 * PREFIX_BLOCKS and stats.disk_blocks_loaded == PREFIX_BLOCKS
    assert stats.disk_reloads == 1 and stats.disk_load_failures == 0
    restarted.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "index"])
def test_a_damaged_block_file_is_a_miss_and_the_output_stays_correct(tmp_path, cold, damage):
    seen, prompt = prompt_pair(2)
    warm_disk(tmp_path, seen)
    (directory,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    slab, index = directory / "slab-0.kv", directory / "slab-0.idx"
    block_bytes = os.path.getsize(slab) // 256
    if damage == "flip":  # one byte of the fourth block
        with open(slab, "r+b") as file:
            file.seek(3 * block_bytes + 100)
            byte = file.read(1)
            file.seek(3 * block_bytes + 100)
            file.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "truncate":  # only the first 5 blocks remain
        os.truncate(slab, 5 * block_bytes + 17)
    elif damage == "delete":
        slab.unlink()
    else:  # garbage over the index
        with open(index, "r+b") as file:
            file.write(os.urandom(os.path.getsize(index)))
    restarted = engine(tmp_path)
    output = run(restarted, prompt)
    assert output.token_ids == run(cold, prompt).token_ids
    expected = {"flip": 3, "truncate": 5, "delete": 0, "index": 0}[damage]
    assert output.num_cached_tokens == 16 * expected
    if damage == "flip":
        assert restarted.stats().cache.disk_load_failures == 1
        assert restarted.backing["disk"]["full"].stats().read_failures == 1
    restarted.close()


@pytest.mark.parametrize("change", [{"seed": 1}, {"block_size": 32}])
def test_another_model_or_block_size_never_reads_the_blocks(tmp_path, cold, change):
    seen, prompt = prompt_pair(3)
    warm_disk(tmp_path, seen)
    other = engine(tmp_path, **change)
    output = run(other, prompt)
    assert output.num_cached_tokens == 0
    assert other.stats().cache.disk_blocks_loaded == 0
    if change == {"block_size": 32}:  # same weights: same tokens as the cold engine
        assert output.token_ids == run(cold, prompt).token_ids
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2
    other.close()


def test_two_replicas_on_one_directory_read_each_others_blocks(tmp_path, cold):
    seen, prompt = prompt_pair(4)
    writer, reader = engine(tmp_path), engine(tmp_path)
    assert (writer.backing["disk"]["full"].slab, reader.backing["disk"]["full"].slab) == (0, 1)
    run(writer, seen)
    writer.backing["disk"]["full"].flush()
    time.sleep(kv_disk.PEER_REFRESH_S)
    output = run(reader, prompt)
    assert output.token_ids == run(cold, prompt).token_ids
    assert output.num_cached_tokens == 16 * PREFIX_BLOCKS
    assert reader.stats().cache.disk_hits == 16 * PREFIX_BLOCKS
    assert reader.backing["disk"]["full"].stats().num_cached == 0  # read from the writer's slab
    writer.close()
    reader.close()


def test_the_disk_budget_is_never_exceeded(tmp_path):
    small = engine(tmp_path, disk_blocks=8)
    store = small.backing["disk"]["full"]
    assert store.num_slots == 8
    rng = random.Random(5)
    for i in range(6):
        run(small, [rng.randrange(256) for _ in range(100)], f"r{i}")
        assert store.stats().num_cached <= 8
    store.flush()
    stats = store.stats()
    assert stats.num_cached == 8 and stats.evictions == stats.blocks_written - 8 > 0
    slab = os.path.join(store.directory, "slab-0.kv")
    assert os.path.getsize(slab) == 8 * store.block_bytes
    small.close()


def test_the_cost_rule_on_both_sides_of_its_threshold():
    # 4 blocks: reload 4 x (disk 1 ms + host 0.1 ms) = 4.4 ms against 4 x recompute.
    assert reload_pays(4, 4 * 0.001, recompute_s=0.0012, host_load_s=0.0001)
    assert not reload_pays(4, 4 * 0.001, recompute_s=0.0010, host_load_s=0.0001)
    assert reload_pays(4, 0.0, recompute_s=0.0002, host_load_s=0.0001)


@pytest.mark.parametrize("recompute_s", [1e-9, 1.0])
def test_the_engine_recomputes_a_disk_prefix_that_costs_more_to_read(tmp_path, cold, recompute_s):
    seen, prompt = prompt_pair(6)
    warm_disk(tmp_path, seen)
    restarted = engine(tmp_path)
    restarted.kv_cache.set_block_costs(BlockCosts(recompute_s, 1e-6, 1e-6))
    output = run(restarted, prompt)
    assert output.token_ids == run(cold, prompt).token_ids
    stats = restarted.stats().cache
    reloads = recompute_s == 1.0
    assert (stats.disk_reloads, stats.disk_recomputes) == ((1, 0) if reloads else (0, 1))
    assert output.num_cached_tokens == (16 * PREFIX_BLOCKS if reloads else 0)
    restarted.close()


@pytest.mark.parametrize(
    ("errno", "message"), [(28, "No space left on device"), (30, "Read-only file system")]
)
def test_a_disk_that_fails_to_write_leaves_a_two_tier_cache(
    tmp_path, cold, monkeypatch, caplog, errno, message
):
    seen, prompt = prompt_pair(7)
    failing = engine(tmp_path)

    def failing_disk(fd, data, offset):
        raise OSError(errno, message)

    monkeypatch.setattr(os, "pwrite", failing_disk)
    with caplog.at_level(logging.WARNING, logger="replicas.kv.disk"):
        run(failing, seen, "a")
        failing.backing["disk"]["full"].flush()
        output = run(failing, prompt, "b")
    assert output.token_ids == run(cold, prompt).token_ids
    assert output.num_cached_tokens == 16 * PREFIX_BLOCKS  # from the NPU tier
    assert not failing.backing["disk"]["full"].enabled
    warnings = [r for r in caplog.records if "disk tier off" in r.getMessage()]
    assert len(warnings) == 1 and message in warnings[0].getMessage()
    failing.close()


def test_a_disk_path_that_cannot_be_created_leaves_a_two_tier_cache(tmp_path, cold, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    seen, prompt = prompt_pair(8)
    with caplog.at_level(logging.WARNING, logger="replicas.kv.disk"):
        unusable = engine(blocker / "kv")
    assert not unusable.backing["disk"]["full"].enabled
    run(unusable, seen, "a")
    output = run(unusable, prompt, "b")
    assert output.token_ids == run(cold, prompt).token_ids
    assert any("disk tier off" in r.getMessage() for r in caplog.records)
    unusable.close()


def test_a_hung_disk_read_times_out_and_frees_every_block(tmp_path, cold, monkeypatch):
    seen, prompt = prompt_pair(9)
    warm_disk(tmp_path, seen)
    restarted = engine(tmp_path)
    slow_read = restarted.backing["disk"]["full"]._file.read

    def hung(*args):
        time.sleep(0.6)
        return slow_read(*args)

    monkeypatch.setattr(restarted.backing["disk"]["full"]._file, "read", hung)
    monkeypatch.setattr(onboarding, "ONBOARD_TIMEOUT_MIN_S", 0.2)
    monkeypatch.setattr(onboarding, "ONBOARD_TIMEOUT_FACTOR", 0.0)
    output = run(restarted, prompt)
    assert output.token_ids == run(cold, prompt).token_ids
    assert restarted.stats().cache.disk_load_timeouts == 1
    plan = restarted.kv_cache.take_transfer_plan()
    restarted.core.run_transfers(plan, wait=True)  # waits for the reads, which end later
    assert restarted.kv_cache.views.usage()["full"].of(Tier.HOST).num_used == 0
    restarted.check_integrity()
    restarted.close()


def test_a_request_aborted_while_its_disk_reads_run_frees_every_block(tmp_path, monkeypatch):
    seen, prompt = prompt_pair(10)
    warm_disk(tmp_path, seen)
    restarted = engine(tmp_path)
    slow_read = restarted.backing["disk"]["full"]._file.read
    monkeypatch.setattr(
        restarted.backing["disk"]["full"]._file,
        "read",
        lambda *a: (time.sleep(0.05), slow_read(*a))[1],
    )
    restarted.add_request("r", prompt, GREEDY)
    restarted.step()
    assert restarted.kv_cache.onboarding.num_onboarding == 1
    restarted.abort_request("r")
    plan = restarted.kv_cache.take_transfer_plan()
    restarted.core.run_transfers(plan, wait=True)  # waits for the reads
    usage = restarted.kv_cache.views.usage()["full"]
    assert usage.of(Tier.HOST).num_used == 0 and usage.of(Tier.NPU).num_used == 0
    assert usage.of(Tier.HOST).num_cached == PREFIX_BLOCKS  # the reads landed: cached, unused
    restarted.check_integrity()
    restarted.close()


def test_disk_options_are_checked_at_start_up():
    with pytest.raises(ValueError, match=r"disk_path \(--experimental-kv-offload-disk-path\) "):
        KVOffloadConfig(disk_path="/tmp/kv", disk_bytes=2**30)  # no host tier
    with pytest.raises(ValueError, match=r"needs disk_bytes \(--experimental-kv-offload-disk-gb"):
        KVOffloadConfig(enabled=True, host_memory_ratio=1.0, disk_path="/tmp/kv")
    with pytest.raises(ValueError, match=r"disk_bytes .* must be positive"):
        KVOffloadConfig(enabled=True, host_memory_ratio=1.0, disk_path="/tmp/kv", disk_bytes=0)
    parser = build_parser()
    args = parser.parse_args(
        [
            "serve",
            "tiny",
            "--experimental-kv-offload-host-memory-ratio",
            "1",
            "--experimental-kv-offload-disk-path",
            "/tmp/kv",
            "--experimental-kv-offload-disk-gb",
            "2",
            "--data-parallel-size",
            "2",
        ]
    )
    config = build_config(args)
    offload = config.scheduler.kv_offload_config
    assert offload.disk_path == "/tmp/kv" and offload.disk_bytes == 2 * 2**30
    share = config.engine_config().scheduler_config.kv_offload_config
    assert share.disk_bytes == 2**30  # divided among the replicas like the host budget


def test_a_restarted_replica_announces_its_disk_blocks_to_the_router(tmp_path):
    seen, prompt = prompt_pair(11)
    warm_disk(tmp_path, seen)
    restarted = engine(tmp_path)
    restarted.kv_cache.views.enable_events()
    announced = restarted.kv_cache.views.drain_events()
    disk = [e for e in announced if e.tier == Tier.DISK]
    assert len(disk) >= PREFIX_BLOCKS and {e.kind for e in disk} == {KVEventKind.STORED}
    router = Router(2, 16, RoutingConfig())
    router.set_nodes(["node", "node"])
    assert router.on_events(KVEventBatch(0, 0, tuple(announced)))
    hashes = block_hashes(prompt, 16)
    matches = router._caches.match(hashes, router.live_replicas())
    assert [m.num_blocks_in(Tier.DISK) for m in matches] == [PREFIX_BLOCKS] * 2
    snapshot = restarted.kv_cache.views.snapshot(0, len(announced))
    assert set(snapshot.hashes(Tier.DISK)) == {e.block_hash for e in disk}
    restarted.close()


def test_metrics_show_the_disk_tier(tmp_path):
    from cluster.backend import ReplicaStats
    from cluster.metrics import _replica_families

    seen, prompt = prompt_pair(12)
    warm_disk(tmp_path, seen)
    restarted = engine(tmp_path)
    run(restarted, prompt)
    families = {f.name: f for f in _replica_families([ReplicaStats(0, True, restarted.stats())])}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    assert (
        samples[("strata_prefix_cache_hits_by_tier_total", (("replica", "0"), ("tier", "disk")))]
        == 16 * PREFIX_BLOCKS
    )
    assert (
        samples[("strata_prefix_cache_hits_by_tier_total", (("replica", "0"), ("tier", "host")))]
        == 0
    )
    capacity = (
        "strata_kv_blocks_capacity",
        (("cache_type", "full"), ("replica", "0"), ("tier", "disk")),
    )
    assert samples[capacity] == 256
    event = ("strata_kv_disk_tier_total", (("event", "blocks_loaded"), ("replica", "0")))
    assert samples[event] == PREFIX_BLOCKS
    restarted.close()


def small_engine(disk_path, **policy) -> Engine:
    """12 NPU blocks, 12 host blocks and 256 disk blocks of the tiny model."""
    offload = KVOffloadConfig(
        enabled=True,
        host_memory_ratio=1.0,
        disk_path=str(disk_path),
        disk_bytes=256 * 64 * 2**10,
        **policy,
    )
    return Engine(
        EngineConfig(
            model="tiny",
            num_npu_blocks=12,
            scheduler_config=SchedulerConfig(kv_offload_config=offload),
        )
    )


def test_write_back_moves_host_evictions_to_disk_and_outputs_stay_correct(tmp_path, cold):
    rng = random.Random(13)
    prefixes = [[rng.randrange(256) for _ in range(96)] for _ in range(8)]  # 48 blocks
    # 12 host blocks: most of the set lives on disk
    small = small_engine(tmp_path, write_through_threshold=0, write_back=True)
    for round_ in range(2):
        for i, prefix in enumerate(prefixes):
            prompt = [*prefix, 200 + i]
            output = run(small, prompt, f"r{round_}-{i}")
            assert output.token_ids == run(cold, prompt, f"c{round_}-{i}").token_ids
            if round_:  # every prefix was written back to host, then to disk
                assert output.num_cached_tokens == 96
    stats = small.stats().cache
    assert stats.write_backs > 0 and stats.disk_blocks_stored > 0 and stats.disk_hits > 0
    usage = small.kv_cache.views.usage()["full"]
    assert usage.of(Tier.HOST).num_used == 0 and usage.of(Tier.NPU).num_used == 0
    small.close()


def test_a_read_landing_while_the_step_schedules_is_not_a_stall(tmp_path, cold, monkeypatch):
    seen, prompt = prompt_pair(14)
    warm_disk(tmp_path, seen)
    restarted = engine(tmp_path)
    store = restarted.backing["disk"]["full"]
    slow_read = store._file.read
    monkeypatch.setattr(store._file, "read", lambda *a: (time.sleep(0.002), slow_read(*a))[1])
    schedule = restarted.core.scheduler.schedule

    def schedule_then_let_reads_land():
        output = schedule()
        for _, future in restarted.transfer._reads:
            future.result()  # the reads end after the scheduler looked, before the step polls
        return output

    monkeypatch.setattr(restarted.core.scheduler, "schedule", schedule_then_let_reads_land)
    output = run(restarted, prompt)  # raised "cannot be scheduled with nothing running" once
    assert output.token_ids == run(cold, prompt).token_ids
    assert output.num_cached_tokens == 16 * PREFIX_BLOCKS
    restarted.close()


def adaptive_engine(disk_path, threshold: int) -> Engine:
    return small_engine(disk_path, write_through_threshold=threshold, retention="adaptive")


def test_adaptive_retention_stores_host_evictions_to_disk_while_they_come_back(tmp_path, cold):
    rng = random.Random(15)
    prefixes = [[rng.randrange(256) for _ in range(96)] for _ in range(8)]  # 48 blocks
    adaptive = adaptive_engine(tmp_path / "reused", 1)
    for round_ in range(6):
        for i, prefix in enumerate(prefixes):
            prompt = [*prefix, 200 + i]
            output = run(adaptive, prompt, f"r{round_}-{i}")
            if round_ == 5:
                assert output.token_ids == run(cold, prompt, f"c{i}").token_ids
    stats = adaptive.stats().cache
    assert stats.disk_blocks_stored > 0 and stats.disk_hits > 0
    assert stats.disk_write_back_skips < stats.disk_blocks_stored  # reuse keeps it storing
    adaptive.close()

    # Promoted to host at their second request, never reloaded from host: only the adaptive
    # choice at host eviction sends them to disk.
    one_off = adaptive_engine(tmp_path / "one-off", 1)
    for i in range(40):  # 240 blocks, each prompt seen twice in a row, then never again
        prompt = [rng.randrange(256) for _ in range(96)] + [i]
        run(one_off, prompt, f"a{i}")
        run(one_off, prompt, f"b{i}")
    stats = one_off.stats().cache
    assert stats.disk_write_back_skips > stats.disk_blocks_stored / 2  # it learnt to stop
    assert stats.disk_hits == 0
    one_off.close()


def test_the_cost_rules_inputs_are_in_the_stats(tmp_path):
    seen, prompt = prompt_pair(16)
    warm_disk(tmp_path, seen)
    restarted = engine(tmp_path)
    costs = restarted.stats().reload_costs
    assert costs.recompute_s == 0.0 and costs.read_s["disk"] > 0  # nothing measured yet
    restarted.kv_cache.set_block_costs(BlockCosts(0.5, 0.01, 0.01))
    costs = restarted.stats().reload_costs
    assert (costs.recompute_s, costs.host_load_s) == (0.5, 0.01)
    run(restarted, prompt)
    measured = restarted.stats().reload_costs.read_s["disk"]
    disk = restarted.backing["disk"]["full"].stats()
    assert measured == pytest.approx(disk.read_seconds / disk.blocks_read)
    restarted.close()
