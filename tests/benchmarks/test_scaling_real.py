"""The real ``scaling`` benchmark's deployment config keeps what its scale-in target assumes: every
block a replica computes reaches the node's disk tier (through host), so a survivor can read a
removed replica's prefixes back. ``write_through_threshold: 0`` turns write-through off, which
leaves the host and disk tiers empty until a write-out."""

import random

from benchmarks.scaling_real import BLOCK_SIZE, Settings, _config
from benchmarks.workload import random_tokens
from replicas.engine.engine import Engine
from replicas.kv.hashing import block_hashes
from tests.unit.engine_runs import run


def test_every_prefix_block_reaches_the_disk_tier_before_any_scale_in(tmp_path):
    settings = Settings()
    engine = Engine(_config(settings, 1, tmp_path).engine_config())
    rng = random.Random(0)
    prefixes = [random_tokens(rng, settings.prefix_len) for _ in range(2)]
    for i, prefix in enumerate(prefixes):
        run(engine, prefix + random_tokens(rng, settings.question_len), f"r{i}")
    run(engine, random_tokens(rng, BLOCK_SIZE + 1), "last")  # the previous stores land
    disk = engine.backing["disk"]["full"]
    disk.flush()
    on_disk = set(disk.cached_hashes())
    num_blocks = settings.prefix_len // BLOCK_SIZE
    for prefix in prefixes:
        assert set(block_hashes(prefix, BLOCK_SIZE)[:num_blocks]) <= on_disk
    assert engine.kv_cache.stats.disk_blocks_stored >= 2 * num_blocks
