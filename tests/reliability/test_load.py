"""Load, back-pressure, disconnects and NPU exhaustion over real HTTP on 127.0.0.1.

The server is ``strata serve``'s app (``cluster.server.build_app``) over two Ray replicas on the
session's Ray instance, served by uvicorn. Each test prints one ``FIGURES`` line (counts, RSS)
for RELIABILITY.md. ``STRATA_LOAD_ROUND_S`` sets the length of each load round (default 20 s).
"""

import asyncio
import os
import random

import pytest

from cluster.api import create_app
from cluster.backend import LocalBackend
from cluster.config import ClusterConfig
from replicas.config import EngineConfig, SchedulerConfig
from replicas.engine.engine import Engine
from tests.reliability.conftest import (
    UvicornThread,
    figures,
    metric_sum,
    rss_bytes,
    scrape,
    serve_on_ray,
    wait_for,
    wait_until_clean,
)
from tests.reliability.traffic import HANG_UP_MODES, burst, hang_up, request_body, run_clients

ROUND_S = float(os.environ.get("STRATA_LOAD_ROUND_S", "20"))
NUM_CLIENTS = 64
RSS_GROWTH_LIMIT = 1.15


def dp2_config(**sections: dict) -> ClusterConfig:
    data = {
        "data_parallel_size": 2,
        "model": {"model": "tiny", "num_npu_blocks": 256},
        "scheduler": {
            "max_num_seqs": 32,
            "kv_offload_config": {"enabled": True, "host_memory_ratio": 1.0},
        },
        "server": {"max_tokens_limit": 256},
        "ray": {"cpus_per_replica": 0.5},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return ClusterConfig.model_validate(data)


@pytest.fixture(scope="module")
def served(ray_session):
    with serve_on_ray(dp2_config(), "rel-load") as running:
        yield running


def test_64_streaming_clients_for_two_rounds(served):
    """Zero errors (or 429 back-pressure), every accepted request completes, every replica is
    clean afterwards, and replica RSS stays flat over a second equal round."""
    server, backend = served
    pids = [int(info["pid"]) for info in backend.replica_infos]
    incarnations = list(backend.health.incarnations)
    rounds, rss = [], []
    for seed in (1, 2):
        tally = asyncio.run(run_clients(server.url, NUM_CLIENTS, ROUND_S, seed=seed))
        reports = wait_until_clean(backend)
        rounds.append(tally)
        rss.append([rss_bytes(pid) for pid in pids])
        assert tally.kinds["error"] == 0 and tally.kinds["failed"] == 0, (
            f"{tally.summary()}\n" + "\n".join(tally.errors)
        )
        assert set(tally.codes) <= {"429:overloaded"}, tally.summary()
        assert tally.kinds["served"] >= NUM_CLIENTS, tally.summary()
        assert len(reports) == 2
    assert backend.health.incarnations == incarnations  # no replica restarted under load
    routed = [r.num_requests_routed for r in asyncio.run(backend.stats()).router.replicas]
    assert all(n > 0 for n in routed), routed  # both replicas took load
    figures(
        "load",
        round_s=ROUND_S,
        clients=NUM_CLIENTS,
        rounds=[
            {
                "requests": t.total,
                "served": t.kinds["served"],
                "rejected_429": t.kinds["rejected"],
                "errors": t.kinds["error"],
                "tokens": t.num_completion_tokens,
                "elapsed_s": round(t.elapsed_s, 1),
            }
            for t in rounds
        ],
        routed_per_replica=routed,
        rss_mib_after_round_1=[round(b / 2**20, 1) for b in rss[0]],
        rss_mib_after_round_2=[round(b / 2**20, 1) for b in rss[1]],
    )
    for first, second in zip(*rss):
        assert second < first * RSS_GROWTH_LIMIT, rss


def test_clients_hanging_up_free_every_block(served):
    """Clients drop at random points (mid-body, after the headers, mid-stream with FIN or RST,
    waiting for a JSON answer): every request is aborted and every block freed."""
    server, backend = served
    before = scrape(server.url)

    async def drops() -> list[str]:
        seen = []
        for wave in range(4):  # 4 waves of 10 concurrent clients
            seen += await asyncio.gather(
                *(
                    hang_up(server.port, HANG_UP_MODES[i % len(HANG_UP_MODES)], random.Random(i))
                    for i in range(wave * 10, wave * 10 + 10)
                )
            )
        return seen

    seen = asyncio.run(drops())
    reports = wait_until_clean(backend)

    def idle() -> dict | None:
        samples = scrape(server.url)
        running = metric_sum(samples, "strata_num_requests_running")
        used = metric_sum(samples, "strata_kv_blocks_used", tier="npu")
        return samples if running == 0 and used == 0 else None

    after = wait_for(idle, "metrics to show no running request and no NPU block in use")
    aborted = metric_sum(after, "strata_requests_total", finish_reason="abort") - metric_sum(
        before, "strata_requests_total", finish_reason="abort"
    )
    mid_stream = seen.count("events")
    figures(
        "disconnects",
        clients=len(seen),
        seen_before_hang_up={s: seen.count(s) for s in sorted(set(seen))},
        aborted=aborted,
        replicas=reports,
    )
    assert mid_stream >= 10, seen  # the mid-stream modes really were mid-stream
    assert aborted >= mid_stream
    normal = request_body(random.Random(0), stream=True, max_tokens=4, chat=False)
    ok = asyncio.run(burst(server.url, [normal]))
    assert [o.kind for o in ok] == ["served"], ok
    wait_until_clean(backend)


def test_a_full_queue_answers_429_end_to_end(ray_session):
    """ServerConfig.max_waiting_requests reaches each ReplicaActor: with one running and one
    waiting request per replica, a burst gets 429 (OpenAI body, Retry-After) for the rest,
    and every accepted request completes."""
    config = dp2_config(scheduler={"max_num_seqs": 1}, server={"max_waiting_requests": 1})
    assert config.server.max_waiting_requests == 1
    with serve_on_ray(config, "rel-429") as (server, backend):
        rng = random.Random(3)
        bodies = [
            request_body(rng, stream=i % 2 == 0, max_tokens=32, chat=i % 5 == 0) for i in range(48)
        ]
        outcomes = asyncio.run(burst(server.url, bodies))
        kinds = [o.kind for o in outcomes]
        codes = {f"{o.status}:{o.detail}" for o in outcomes if o.kind == "rejected"}
        reports = wait_until_clean(backend)
        after = asyncio.run(burst(server.url, bodies[:2]))
    figures(
        "backpressure",
        burst=len(bodies),
        served=kinds.count("served"),
        rejected_429=kinds.count("rejected"),
        errors=[o.detail for o in outcomes if o.kind == "error"][:5],
        replicas=reports,
    )
    assert kinds.count("error") == 0 and kinds.count("failed") == 0, outcomes
    assert kinds.count("rejected") > 0 and codes == {"429:overloaded"}, outcomes
    assert kinds.count("served") >= 2, outcomes  # at least one per replica got through
    assert [o.kind for o in after] == ["served", "served"], after


def test_npu_exhaustion_preempts_and_every_request_completes():
    """Far more concurrent long requests than NPU blocks: the scheduler preempts and
    recomputes; nothing crashes, every request completes, nothing leaks."""
    engine = Engine(
        EngineConfig(
            model="tiny",
            num_npu_blocks=16,
            max_model_len=256,
            scheduler_config=SchedulerConfig(max_num_seqs=16),
        )
    )
    server = UvicornThread(create_app(LocalBackend(engine)))
    try:
        rng = random.Random(5)
        bodies = [
            request_body(rng, stream=i % 2 == 0, max_tokens=64, chat=False) for i in range(16)
        ]
        outcomes = asyncio.run(burst(server.url, bodies))
        wait_for(
            lambda: not engine.has_unfinished_requests() and engine.kv_cache.npu.num_used == 0,
            "the engine to finish",
        )
    finally:
        server.close()
    engine.check_integrity()
    preemptions = engine.stats().num_preemptions
    figures(
        "npu_exhaustion",
        requests=len(bodies),
        served=[o.kind for o in outcomes].count("served"),
        npu_blocks=16,
        preemptions=preemptions,
    )
    assert [o.kind for o in outcomes] == ["served"] * len(bodies), outcomes
    assert preemptions > 0
