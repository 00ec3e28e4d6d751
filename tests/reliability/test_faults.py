"""Replica and router faults under HTTP load, on two Ray replicas behind uvicorn on 127.0.0.1.

kill a replica   -> no request fails: those that had streamed output on it are resumed on the
                    other replica (greedy ones exactly as an uninterrupted run, nothing sent
                    twice), those that had not started are routed again; the router drops
                    the replica, and the health monitor re-adds it once Ray has restarted it
engine failure   -> the replica's process exits, Ray restarts it, the other one serves on
kill the router  -> route() calls wait for Ray to restart it (max_task_retries=-1), nothing
                    fails, and the restarted router rebuilds its prefix index from replica
                    snapshots, so locality routing works again
"""

import asyncio
import time

import httpx
import pytest
import ray

from cluster.backend import ReplicaFailedError
from cluster.config import ClusterConfig
from replicas.kv.events import Tier
from replicas.sampling_params import SamplingParams
from tests.reliability.conftest import (
    figures,
    metric_sum,
    scrape,
    serve_on_ray,
    wait_for,
    wait_until_clean,
)
from tests.reliability.traffic import Outcome, Tally, client_pool, run_clients, send

FAULT_CLIENTS = 16
LOAD_S = 20.0
RESTART_TIMEOUT_S = 120.0


def fault_config() -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "data_parallel_size": 2,
            # Room for every block the load caches: the router test's prefix must not be evicted.
            "model": {"model": "tiny", "num_npu_blocks": 2048},
            # Few running at once, so that some requests wait on each replica when it dies.
            "scheduler": {"max_num_seqs": 4},
            "routing": {"scoring_profile": "load"},
            "ray": {"cpus_per_replica": 0.5},
        }
    )


@pytest.fixture(scope="module")
def served(ray_session):
    with serve_on_ray(fault_config(), "rel-faults") as running:
        yield running


def wait_for_both_live(backend, url: str) -> None:
    def both_live() -> bool:
        router_live = ray.get(backend.router.live_replicas.remote(), timeout=60)
        health = httpx.get(f"{url}/health", timeout=30).json()
        replicas_live = backend.health.num_live == 2
        return replicas_live and router_live == [0, 1] and health["live_replicas"] == 2

    wait_for(both_live, "both replicas to be live again", RESTART_TIMEOUT_S, interval_s=0.5)


async def wait_unreachable(replica, incarnation: str) -> None:
    """Until the killed process no longer answers (bounded): ``ray.kill`` returns before the
    actor is gone, and requests sent meanwhile may still start there."""
    for _ in range(600):
        try:
            if await asyncio.wait_for(replica.ready.remote(), 1.0) != incarnation:
                return
        except Exception:  # lost, restarting, or no answer within a second
            return
        await asyncio.sleep(0.05)


def test_killing_a_replica_loses_no_request(served, ray_session):
    server, backend = served
    old_incarnation = backend.health.incarnations[0]
    counts = backend.dispatcher.counts
    rerouted_before, resumed_before = counts.num_rerouted, counts.num_resumed
    router_views: set[tuple[int, ...]] = set()

    async def scenario():
        load = asyncio.ensure_future(
            run_clients(
                server.url, FAULT_CLIENTS, LOAD_S, seed=11, max_tokens=(16, 64), logprobs=True
            )
        )
        await asyncio.sleep(LOAD_S / 4)
        for _ in range(100):  # bounded: until requests run on replica 0 (a busy machine is slow)
            on_replica_0 = await backend.replicas[0].stats.remote()
            if on_replica_0.num_running:
                break
            await asyncio.sleep(0.1)
        killed_at = time.monotonic()
        ray_session.kill(backend.replicas[0], no_restart=False)
        await wait_unreachable(backend.replicas[0], old_incarnation)
        for _ in range(10_000):  # bounded: the load ends after LOAD_S (each request is bounded)
            if load.done():
                break
            router_views.add(tuple(await backend.router.live_replicas.remote()))
            await asyncio.sleep(0.1)
        return await load, on_replica_0, killed_at

    tally, on_replica_0, killed_at = asyncio.run(scenario())
    wait_for_both_live(backend, server.url)
    reports = wait_until_clean(backend)
    # Greedy requests in flight at the kill, again without a fault: the same tokens, logprobs
    # and text, so that nothing was lost, repeated or changed where a stream was resumed.
    in_flight = [
        o for sent, answered, o in tally.timeline if sent <= killed_at <= answered and o.tokens
    ]
    replayed = asyncio.run(replay([o.body for o in in_flight], server.url))
    resumed = backend.dispatcher.counts.num_resumed - resumed_before
    figures(
        "replica_kill",
        requests=tally.total,
        served=tally.kinds["served"],
        lost=tally.kinds["failed"],
        resumed=resumed,
        in_flight_on_killed_replica=on_replica_0.num_running + on_replica_0.num_waiting,
        running_on_killed_replica=on_replica_0.num_running,
        greedy_in_flight_compared=len(in_flight),
        rerouted=backend.dispatcher.counts.num_rerouted - rerouted_before,
        router_views=sorted(router_views),
        replicas=reports,
    )
    assert tally.kinds["error"] == 0, tally.summary() + "\n" + "\n".join(tally.errors)
    assert tally.kinds["served"] == tally.total, tally.summary()  # nothing lost or rejected
    assert on_replica_0.num_running > 0  # the kill hit requests in flight ...
    assert resumed > 0  # ... and some had streamed output there
    assert in_flight
    for outcome, again in zip(in_flight, replayed, strict=True):
        assert outcome.text == again.text, outcome.body
        assert [t for t, _ in outcome.tokens] == [t for t, _ in again.tokens], outcome.body
        assert [lp for _, lp in outcome.tokens] == pytest.approx(
            [lp for _, lp in again.tokens], abs=1e-3
        )
    counted = metric_sum(scrape(server.url), "strata_requests_resumed_total")
    assert counted == backend.dispatcher.counts.num_resumed
    assert (1,) in router_views  # the router dropped replica 0 ...
    assert backend.health.incarnations[0] != old_incarnation  # ... and re-added its restarted self


async def replay(bodies: list[dict], url: str) -> list[Outcome]:
    """Each request again, one at a time, with no fault; all must be served."""
    outcomes = []
    async with client_pool(url, 1) as client:
        for body in bodies:
            outcome = await send(client, body, Tally())
            assert outcome.kind == "served", outcome
            outcomes.append(outcome)
    return outcomes


def test_an_engine_failure_restarts_only_that_replica(served):
    """A step that raises kills that replica's engine loop: its requests fail, new ones go to
    the other replica, the replica exits, Ray restarts it, and requests on the other replica
    finish. The fault: sampling parameters changed after they were validated, to a seed no torch
    generator takes (standing in for any bug that makes ``Engine.step`` raise)."""
    server, backend = served
    wait_for_both_live(backend, server.url)
    incarnations = list(backend.health.incarnations)
    rerouted_before = backend.dispatcher.counts.num_rerouted
    # Long enough to be running on both replicas when the poison arrives 0.5 s later.
    normal = SamplingParams(max_tokens=512, ignore_eos=True)
    poison = SamplingParams(max_tokens=4, temperature=0.7)
    poison.seed = 2**70  # past validation: the sampler's generator raises inside the step

    async def collect(request_id: str, tokens: list[int], params: SamplingParams):
        final = None
        async for output in backend.generate(request_id, tokens, params):
            final = output
        return final

    async def scenario():
        others = [
            asyncio.ensure_future(collect(f"bystander-{i}", [7, 8, 9, i], normal)) for i in range(4)
        ]
        await asyncio.sleep(0.5)
        with pytest.raises(ReplicaFailedError, match="engine loop failed"):
            await collect("poison", [5, 6, 7], poison)
        # While the failed replica waits to exit it turns requests away, and they go elsewhere.
        newcomers = await asyncio.gather(
            *(collect(f"newcomer-{i}", [4, 4, i], SamplingParams(max_tokens=4)) for i in range(4))
        )
        return await asyncio.gather(*others, return_exceptions=True), newcomers

    results, newcomers = asyncio.run(scenario())
    assert all(n.finish_reason == "length" for n in newcomers)
    wait_for(
        lambda: backend.health.incarnations != incarnations and backend.health.num_live == 2,
        "the failed replica to restart and rejoin",
        RESTART_TIMEOUT_S,
        interval_s=0.5,
    )
    restarted = [i for i in range(2) if backend.health.incarnations[i] != incarnations[i]]
    served = [r for r in results if not isinstance(r, BaseException)]
    figures(
        "engine_failure",
        restarted=restarted,
        bystanders_served=len(served),
        newcomers_served=len(newcomers),
        rerouted=backend.dispatcher.counts.num_rerouted - rerouted_before,
    )
    assert len(restarted) == 1
    for result in results:
        if isinstance(result, BaseException):
            assert isinstance(result, ReplicaFailedError), repr(result)
        else:
            assert result.replica_index != restarted[0] and len(result.token_ids) == 512
    assert served
    wait_until_clean(backend)


def test_router_restart_keeps_serving_and_rebuilds_locality(served, ray_session):
    server, backend = served
    wait_for_both_live(backend, server.url)
    wait_until_clean(backend)
    prefix = "A prefix that only replica 1 has cached, for the router restart test. " * 4

    # Warm replica 1 directly (not through the router): the router learns of the prefix only
    # from replica 1's KV events, and an idle "load" router would otherwise pick replica 0.
    warm = (
        backend.replicas[1]
        .generate.options(num_returns="streaming")
        .remote("warm-1", backend.tokenizer.encode(prefix + "warm"), SamplingParams(max_tokens=1))
    )
    for ref in warm:
        ray.get(ref, timeout=60)

    def indexed_on_1() -> int:
        stats = ray.get(backend.router.stats.remote(), timeout=60)
        return stats.replicas[1].num_indexed_blocks_in(Tier.NPU)

    wait_for(indexed_on_1, "the router to index replica 1's prefix")

    def cached_tokens(question: str) -> int:
        body = {"prompt": prefix + question, "max_tokens": 2, "ignore_eos": True}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    before = cached_tokens("first?")

    async def scenario():
        load = asyncio.ensure_future(run_clients(server.url, 8, 12.0, seed=21))
        await asyncio.sleep(3)
        ray_session.kill(backend.router, no_restart=False)
        return await load

    tally = asyncio.run(scenario())

    def resynced() -> bool:
        stats = ray.get(backend.router.stats.remote(), timeout=60)
        return all(r.is_live and not r.needs_resync and r.num_resyncs >= 1 for r in stats.replicas)

    wait_for(resynced, "the restarted router to rebuild its index from both replicas")
    wait_until_clean(backend)
    after = cached_tokens("second?")
    figures(
        "router_restart",
        requests=tally.total,
        served=tally.kinds["served"],
        errors=tally.kinds["error"],
        cached_tokens_before=before,
        cached_tokens_after=after,
    )
    assert tally.kinds["served"] == tally.total > 0, tally.summary() + "\n".join(tally.errors)
    assert before > 0 and after == before  # routed to replica 1, where the prefix lives
