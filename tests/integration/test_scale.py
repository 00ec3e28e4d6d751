"""Resizing a running Ray deployment (``RayBackend.scale``): under load with no failed request,
the victim chosen by the value of what it alone caches, the disk tier carrying a removed
replica's prefixes to a survivor and warming a new replica, and bad sizes refused.

One deployment serves the cases without a disk tier, one the cases with it (2 cores: each
replica start costs seconds)."""

import asyncio
import time

import pytest
import ray

from cluster.backend import NotScalableError
from cluster.config import ClusterConfig
from cluster.deploy import RayBackend
from cluster.llm import LLM
from cluster.metrics import StrataMetrics
from replicas.kv.events import Tier
from replicas.sampling_params import SamplingParams
from tests.integration.test_cluster import run, run_one

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def scale_config(
    dp: int, drain_timeout_s: float = 1.0, profile: str = "balanced", **scheduler
) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "data_parallel_size": dp,
            "model": {"model": "tiny", "num_npu_blocks": 256},
            "scheduler": scheduler,
            "routing": {"scoring_profile": profile, "ramp_s": 2.0},
            "server": {"drain_timeout_s": drain_timeout_s},
            "ray": {"cpus_per_replica": 0.5},
        }
    )


@pytest.fixture
def backends(ray_session):
    started: list[RayBackend] = []
    yield started
    for backend in started:
        backend.shutdown()


def replica_names(name: str) -> set[str]:
    return {n for n in ray.util.list_named_actors() if n.startswith(f"{name}-replica-")}


def live_indices(backend: RayBackend) -> list[int]:
    return [r.replica_index for r in run(backend.stats()).replicas]


async def direct(backend: RayBackend, index: int, request_id: str, tokens: list[int]):
    """Run one request on replica ``index`` itself, past the router."""
    final = None
    async for output in backend.links[index].generate(request_id, tokens, PARAMS, None):
        final = output
    return final


def assert_clean(backend: RayBackend) -> None:
    for report in run(backend.check_integrity()):
        assert report == {"npu_blocks_used": 0, "host_blocks_used": 0, "num_unfinished": 0}


def test_resize_under_load_refuses_bad_sizes_and_removes_the_least_valuable(backends):
    # Load spread over the replicas, one running request on each and no drain wait: a
    # scale-in sheds the queued requests of the replicas it removes.
    config = scale_config(2, drain_timeout_s=0.0, profile="load", max_num_seqs=1)
    backend = RayBackend(config, name="t-scale")
    backends.append(backend)
    prompts = [[7, 8, 9, *range(20, 20 + 32 + 5 * i)] for i in range(4)]
    reference = [
        run(run_one(backend, f"ref-{i}", p, PARAMS)).token_ids for i, p in enumerate(prompts)
    ]

    # (f) Bad sizes: a ValueError naming why, and the deployment as it was. The session's Ray
    # was started by this process: local to one machine, so a size past it is refused at once.
    local = "can place, and this Ray instance is local to one machine and cannot grow"
    for bad, why in [(0, "at least 1"), (-1, "at least 1"), (2.5, "integer"), (40, local)]:
        with pytest.raises(ValueError, match=why):
            run(backend.scale(bad))
        assert backend.num_replicas() == 2 and replica_names("t-scale") == {
            "t-scale-replica-0",
            "t-scale-replica-1",
        }
        assert live_indices(backend) == [0, 1]

    # (a) 2 -> 3 -> 1 under a steady load of streaming requests: none fails, each completes
    # with the greedy output of its prompt.
    async def under_load() -> tuple[list, list, list]:
        stop = asyncio.Event()
        done: list[tuple[int, list[int]]] = []
        failed: list[BaseException] = []

        async def client(c: int) -> None:
            n = 0
            while not stop.is_set():
                which = (c + n) % len(prompts)
                try:
                    final = None
                    async for output in backend.generate(f"load-{c}-{n}", prompts[which], PARAMS):
                        final = output
                    done.append((which, final.token_ids))
                except Exception as error:  # every failure is a test failure
                    failed.append(error)
                n += 1

        clients = [asyncio.ensure_future(client(c)) for c in range(8)]
        await asyncio.sleep(0.5)
        grown = await backend.scale(3)
        await asyncio.sleep(1.0)
        shrunk = await backend.scale(1)
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*clients)
        return [grown, shrunk], done, failed

    (grown, shrunk), done, failed = run(under_load())
    assert failed == []
    assert len(done) >= 8
    assert all(tokens == reference[which] for which, tokens in done)
    assert (grown.old_size, grown.new_size, grown.added) == (2, 3, (2,))
    assert (shrunk.new_size, len(shrunk.removed)) == (1, 2)
    (survivor,) = live_indices(backend)
    assert replica_names("t-scale") == {f"t-scale-replica-{survivor}"}
    assert backend.num_replicas() == 1 and run(backend.num_live_replicas()) == 1
    stats = run(backend.stats())
    assert [r.replica_index for r in stats.router.replicas] == [survivor]
    text = StrataMetrics().render(stats).decode()
    assert 'strata_replicas{state="target"} 1.0' in text
    assert 'strata_scale_events_total{direction="out"} 1.0' in text
    assert 'strata_scale_events_total{direction="in"} 1.0' in text
    for gone in set(range(3)) - {survivor}:
        assert f'strata_replica_up{{replica="{gone}"}}' not in text
    assert_clean(backend)

    # (b) Back to 3 (indices 3 and 4: never reused); hot prefixes on the survivor and on 4,
    # one prompt seen once on 3: a scale-in removes 3, whatever their indices and loads.
    assert run(backend.scale(3)).added == (3, 4)

    async def construct() -> None:
        for i in range(3):
            await direct(backend, survivor, f"hot-s-{i}", [1, *range(10, 74), 200 + i])
            await direct(backend, 4, f"hot-4-{i}", [2, *range(80, 144), 210 + i])
        await direct(backend, 3, "once-3", [3, *range(150, 182)])

    run(construct())
    result = run(backend.scale(2))
    assert result.removed == (3,), result
    assert sorted(live_indices(backend)) == sorted([survivor, 4])
    assert_clean(backend)

    # Ray re-creates a killed router at its start-up size (2), every start-up replica serving:
    # requests sent at once wait until the deployment has told it its replicas again, and it
    # routes to the live ones only.
    killed = ray.get(backend.router.ready.remote())
    ray.kill(backend.router, no_restart=False)

    async def after_restart():
        backend.health.ensure_running()
        outputs = [await run_one(backend, f"after-{i}", prompts[i], PARAMS) for i in range(4)]
        for _ in range(300):  # the restarted router, told the replicas
            if await backend.router.ready.remote() != killed:
                stats = await backend.router.stats.remote()
                if sorted(r.replica_index for r in stats.replicas) == sorted([survivor, 4]):
                    break
            await asyncio.sleep(0.1)
        return outputs

    outputs = run(after_restart())
    assert {o.replica_index for o in outputs} <= {survivor, 4}
    assert [o.token_ids for o in outputs] == reference
    routing = ray.get(backend.router.stats.remote())
    assert sorted(r.replica_index for r in routing.replicas) == sorted([survivor, 4])


def disk_scheduler(path) -> dict:
    return {
        "kv_offload_config": {
            "enabled": True,
            "host_memory_ratio": 1.0,
            "write_through_threshold": "immediate",
            "disk_path": str(path),
            "disk_bytes": 64 * 2**20,
        }
    }


def test_the_disk_tier_carries_a_removed_replicas_prefix_and_warms_a_new_one(backends, tmp_path):
    backend = RayBackend(scale_config(2, **disk_scheduler(tmp_path)), name="t-scale-disk")
    backends.append(backend)
    hot = [1, *range(10, 74)]  # 4 blocks, hit again and again on replica 0
    only = [2, *range(80, 144), 9]  # 4 blocks, seen once, on replica 1 alone

    async def construct():
        for i in range(3):
            await direct(backend, 0, f"hot-{i}", [*hot, 200 + i])
        return await direct(backend, 1, "only", only)

    cold = run(construct())
    assert cold.num_cached_tokens == 0
    result = run(backend.scale(1))
    assert result.removed == (1,), result

    # (c) The removed replica's prefix is served from the node's disk by the survivor.
    time.sleep(0.5)  # the survivor re-reads the other slabs' index files
    again = run(run_one(backend, "again", only, PARAMS))
    assert again.replica_index == 0
    assert again.num_cached_tokens >= 64
    assert again.token_ids == cold.token_ids

    # (d) A new replica loads the disk blocks into its host tier before it takes traffic:
    # the router indexes them at once, and its first request for one is a hit.
    run(backend.scale(2))
    (new,) = [i for i in live_indices(backend) if i != 0]
    assert new == 2
    routing = {r.replica_index: r for r in run(backend.stats()).router.replicas}
    assert routing[new].num_indexed_blocks_in(Tier.HOST) >= 4
    first = run(direct(backend, new, "first", [*hot, 250]))
    assert first.num_cached_tokens == 64
    assert_clean(backend)


def test_llm_scale_resizes_and_its_stats_follow_the_live_set(ray_session):
    with (
        LLM("tiny", num_npu_blocks=64) as local,
        pytest.raises(NotScalableError, match="use_for_one_replica"),
    ):
        local.scale(2)
    config = scale_config(1).model_copy(deep=True)
    config.ray.use_for_one_replica = True
    with LLM.from_config(config) as llm:
        assert llm.engine is None and llm.num_replicas() == 1
        before = llm.generate([5, 6, 7, 8], PARAMS)
        assert llm.scale(2).added == (1,)
        assert [r.replica_index for r in llm.replica_stats()] == [0, 1]
        assert llm.generate([5, 6, 7, 8], PARAMS).token_ids == before.token_ids
        assert len(llm.scale(1).removed) == 1
        assert len(llm.replica_stats()) == 1 and llm.num_replicas() == 1
        llm.check_integrity()
