"""The Ray deployment: routing by locality and load, scaling by config, replica faults."""

import asyncio
import statistics
import time

import pytest

from cluster.config import ClusterConfig
from cluster.deploy import RayBackend
from cluster.llm import LLM
from replicas.cache_hints import CacheHints
from replicas.config import KVOffloadConfig
from replicas.kv.events import Tier
from replicas.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def make_config(
    dp: int = 2, profile: str = "balanced", routing: dict | None = None, **model
) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "data_parallel_size": dp,
            "model": {"model": "tiny", "num_npu_blocks": 256, **model},
            "routing": routing or {"scoring_profile": profile},
            "ray": {"cpus_per_replica": 0.5},
        }
    )


async def run_one(
    backend: RayBackend, request_id: str, tokens: list[int], params: SamplingParams = PARAMS
):
    final = None
    async for output in backend.generate(request_id, tokens, params):
        final = output
    return final


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.fixture
def deploy(ray_session):
    backends = []

    def _deploy(config: ClusterConfig, name: str) -> RayBackend:
        backend = RayBackend(config, name=name)
        backends.append(backend)
        return backend

    yield _deploy
    for backend in backends:
        backend.shutdown()


def test_locality_keeps_a_shared_prefix_on_one_replica_and_load_spreads(deploy):
    prefix = list(range(1, 161))  # 10 full blocks
    local = deploy(make_config(profile="locality"), "t-locality")
    replicas = []
    for i in range(6):
        out = run(run_one(local, f"loc-{i}", [*prefix, 200 + i]))
        replicas.append(out.replica_index)
        if i:
            assert out.num_cached_tokens == 160
        time.sleep(0.2)  # let the replica's KV events reach the router
    assert len(set(replicas)) == 1, replicas

    spread = deploy(make_config(profile="load"), "t-load")

    async def concurrent():
        return await asyncio.gather(
            *(
                run_one(
                    spread,
                    f"load-{i}",
                    [*prefix, 200 + i],
                    SamplingParams(max_tokens=24, ignore_eos=True),
                )
                for i in range(6)
            )
        )

    outputs = run(concurrent())
    assert {o.replica_index for o in outputs} == {0, 1}
    for backend in (local, spread):
        for report in run(backend.check_integrity()):
            assert report == {"npu_blocks_used": 0, "host_blocks_used": 0, "num_unfinished": 0}


@pytest.mark.parametrize("dp, profile", [(2, "balanced"), (3, "ttft")])
def test_data_parallel_size_sets_the_number_of_replica_actors(deploy, ray_session, dp, profile):
    """Also: the ttft profile without a configured cost profile routes with the median of the
    step costs each replica measured at start-up."""
    backend = deploy(make_config(dp=dp, profile=profile), f"t-dp{dp}")
    names = ray_session.util.list_named_actors()
    replicas = {n for n in names if n.startswith(f"t-dp{dp}-replica-")}
    assert replicas == {f"t-dp{dp}-replica-{i}" for i in range(dp)}
    assert run(backend.num_live_replicas()) == dp
    outputs = [run(run_one(backend, f"dp-{i}", [5, 6, 7, i])) for i in range(dp)]
    assert all(o.finish_reason == "length" for o in outputs)
    costs = ray_session.get(backend.router.ttft_costs.remote())
    measured = ray_session.get([r.step_costs.remote() for r in backend.replicas])
    if profile != "ttft":
        assert costs is None and measured == [None] * dp
        return
    assert all(m.prefill_s_per_token > 0 for m in measured)
    for name, value in costs.model_dump().items():
        if name not in ("slack", "forfeit_weight", "tier_reload_s_per_block"):  # config only
            assert value == statistics.median(getattr(m, name) for m in measured), name

    # A restarted router asks the replicas for their measurements again, and routes with them.
    def resyncs() -> list[int]:
        return [r.num_resyncs for r in ray_session.get(backend.router.stats.remote()).replicas]

    before = resyncs()
    ray_session.kill(backend.router, no_restart=False)
    deadline = time.monotonic() + 60
    while (counts := resyncs()) == before or not any(counts):  # a restarted router resyncs
        assert time.monotonic() < deadline, "the router was not restarted"
        time.sleep(0.2)  # the killed router may answer until it is gone
    output = run(run_one(backend, "after-restart", [5, 6, 7, 8]))
    assert output.finish_reason == "length"
    assert ray_session.get(backend.router.ttft_costs.remote()) == costs
    # ... and which node each runs on (replicas of one node read each other's disk blocks).
    nodes = [str(r["node_id"]) for r in backend.replica_infos]
    while (known := ray_session.get(backend.router.nodes.remote())) is None:
        assert time.monotonic() < deadline, "the restarted router never learned the nodes"
        time.sleep(0.2)
    assert known == nodes


def test_killing_a_replica_resumes_its_requests_and_it_rejoins(deploy, ray_session):
    """The killed replica's streams go on on the other one (resumed from the tokens sent, or
    routed again when none was), so every request gets all its tokens."""
    backend = deploy(make_config(profile="load"), "t-kill")
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def scenario():
        streams = [
            asyncio.ensure_future(run_one(backend, f"k-{i}", [9, 9, i], long)) for i in range(4)
        ]
        await asyncio.sleep(1.0)
        ray_session.kill(backend.replicas[0], no_restart=False)
        results = await asyncio.gather(*streams, return_exceptions=True)
        return results

    results = run(scenario())
    assert not [r for r in results if isinstance(r, Exception)], results
    assert all(len(r.token_ids) == 400 for r in results)
    assert all(r.replica_index == 1 for r in results)  # every stream ended on the survivor
    assert backend.dispatcher.counts.num_resumed + backend.dispatcher.counts.num_rerouted >= 1

    async def after():
        assert await backend.num_live_replicas() >= 1  # /health stays 200
        outputs = [await run_one(backend, f"after-{i}", [1, 2, 3, i]) for i in range(3)]
        deadline = time.monotonic() + 60
        while await backend.num_live_replicas() < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        return outputs, await backend.num_live_replicas()

    outputs, live = run(after())
    assert all(o.finish_reason == "length" for o in outputs)
    assert live == 2  # Ray restarted the replica and it rejoined routing


def test_llm_resets_the_prefix_cache_and_sums_the_stats_of_every_replica(ray_session):
    """``LLM`` with two replicas drives the Ray deployment; ``reset_prefix_cache`` empties both
    replicas' caches. Round-robin routing alternates replicas 0, 1, 0, 1, ... one call at a time."""
    prompt = [*range(1, 65), 100]  # 4 full blocks and one more token

    with LLM.from_config(make_config(routing={"policy": "round-robin"})) as llm:

        def send_twice() -> list[tuple[int, int]]:
            outputs = [llm.generate(prompt, PARAMS) for _ in range(2)]
            return [(o.replica_index, o.num_cached_tokens) for o in outputs]

        assert send_twice() == [(0, 0), (1, 0)]  # each replica computes and caches it
        assert send_twice() == [(0, 64), (1, 64)]  # both hold it now
        llm.reset_prefix_cache()
        assert send_twice() == [(0, 0), (1, 0)]  # neither holds it any longer
        llm.check_integrity()
        replicas = llm.replica_stats()
        assert [r.replica_index for r in replicas] == [0, 1]
        total = llm.stats()  # the sum over both replicas
        assert total.cache.queries == sum(r.engine.cache.queries for r in replicas) > 0
        assert total.cache.hits == 2 * 64
        usage = [r.engine.cache_types["full"] for r in replicas]
        num_npu_blocks = sum(u.of(Tier.NPU).num_blocks for u in usage)
        assert total.cache_types["full"].of(Tier.NPU).num_blocks == num_npu_blocks


def test_a_full_replica_passes_the_request_to_the_next_best_one(deploy):
    """Cluster-wide admission: replica 0 runs one request and queues another (its limit); a
    third request that prefers replica 0 (same prefix, locality profile) is offered to replica
    1 instead of getting 429 (test_load checks the 429 once every replica is full)."""
    config = make_config(profile="locality", max_model_len=1024)
    config = config.model_copy(
        update={
            "scheduler": config.scheduler.model_copy(update={"max_num_seqs": 1}),
            "server": config.server.model_copy(update={"max_waiting_requests": 1}),
        }
    )
    backend = deploy(config, "t-admission")
    prefix = list(range(1, 161))  # 10 full blocks
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def scenario():
        first = backend.generate("a", [*prefix, 1], long)
        running = await anext(first)  # replica 0 runs it now
        # b must follow a's prefix to replica 0: wait until replica 0's report of it (sent
        # after the step, fire-and-forget) is in the router's index, else b goes by load alone.
        deadline = time.monotonic() + 30
        while (await backend.router.stats.remote()).num_indexed_hashes < len(prefix) // 16:
            assert time.monotonic() < deadline, "the router never indexed request a's prefix"
            await asyncio.sleep(0.01)
        queued = asyncio.ensure_future(run_one(backend, "b", [*prefix, 2], long))
        while (await backend.replicas[0].stats.remote()).num_waiting < 1:
            assert time.monotonic() < deadline, "request b never queued on replica 0"
            await asyncio.sleep(0.01)
        third = await run_one(backend, "c", [*prefix, 3])
        outcomes = [running.replica_index, third.replica_index]
        await first.aclose()
        await queued
        return outcomes

    assert run(scenario()) == [0, 1]
    assert backend.dispatcher.counts.num_overload_reroutes >= 1


def test_replicas_are_sized_to_the_cpus_ray_gives_them(deploy, ray_session):
    """Unset ``cpus_per_replica``: the available CPUs shared among the replicas, and each
    replica computes with one torch thread per whole CPU it reserved; an explicit setting wins.
    Unset pool: sized before the replica starts (the tiny model's four contexts), pinned in its
    config and declared to Ray with its weights as the bundle's memory."""
    config = make_config(dp=1, num_npu_blocks=None)
    auto = config.model_copy(
        update={"ray": config.ray.model_copy(update={"cpus_per_replica": None})}
    )
    # Earlier tests' reservations are released asynchronously: wait until every CPU is free.
    total = ray_session.cluster_resources()["CPU"]
    deadline = time.monotonic() + 60
    while ray_session.available_resources().get("CPU", 0) < total:
        assert time.monotonic() < deadline, "the CPUs of earlier deployments were not released"
        time.sleep(0.2)
    backend = RayBackend(auto, name="t-sized")
    try:
        assert backend.placement.num_cpus == int(total)  # one replica: the whole machine
        assert backend.replica_infos[0]["num_threads"] == int(total)
        assert backend.replica_infos[0]["num_npu_blocks"] == 4096
        assert backend.placement.npu_kv_memory_bytes == 4096 * 65536
        assert 4096 * 65536 < backend.placement.bundle["memory"] < 300 * 2**20
    finally:
        backend.shutdown()
    explicit = deploy(make_config(dp=1), "t-sized-explicit")
    assert explicit.placement.num_cpus == 0.5
    assert explicit.replica_infos[0]["num_threads"] == 1


def test_outputs_of_concurrent_requests_share_one_message_per_step(deploy):
    backend = deploy(make_config(dp=1), "t-batched")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [[(13 * i + j) % 250 + 1 for j in range(48)] for i in range(8)]

    async def all_at_once():
        return await asyncio.gather(
            *(run_one(backend, f"b{i}", p, params) for i, p in enumerate(prompts))
        )

    finals = run(all_at_once())
    reference = LLM("tiny", num_npu_blocks=256).generate(prompts, params)

    def summary(output):
        return output.prompt_token_ids, output.token_ids, output.text, output.finish_reason

    assert [summary(f) for f in finals] == [summary(r) for r in reference]
    link = backend.links[0]
    assert link.num_items >= 8 * 8
    assert link.num_messages <= link.num_items / 4  # eight requests decode in each step
    front = run(backend.stats()).front
    assert front.num_stream_messages == link.num_messages and front.stream_seconds > 0
    assert front.num_routes == 8
    assert front.num_route_calls < front.num_routes  # requests that arrived together: one call


def test_prompt_cache_key_keeps_a_session_on_one_replica_and_retains_its_prefix(deploy):
    config = make_config(routing={"scoring_profile": "load"})
    offload = KVOffloadConfig(enabled=True, host_memory_ratio=1.0)
    config = config.model_copy(
        update={"scheduler": config.scheduler.model_copy(update={"kv_offload_config": offload})}
    )
    backend = deploy(config, "t-cache-key")
    retain = CacheHints(key="session", retain_tokens=64, ttl_s=300.0)

    async def session(hints: CacheHints | None, tag: str) -> list[int]:
        replicas = []
        for i in range(4):  # unrelated prompts: only the key ties them together
            tokens = [(7 * i + j) % 250 + 1 for j in range(70)]
            final = None
            async for output in backend.generate(f"{tag}-{i}", tokens, PARAMS, None, hints):
                final = output
            replicas.append(final.replica_index)
        return replicas

    assert len(set(run(session(None, "plain")))) == 2  # the load profile alternates idle ties
    keyed = run(session(retain, "keyed"))
    assert len(set(keyed)) == 1, keyed
    stats = run(backend.stats())
    usage = stats.replicas[keyed[0]].engine.cache_types["full"]
    assert usage.of(Tier.HOST).num_retained == 4 * 4  # 64 tokens: 4 blocks of each prompt
    for report in run(backend.check_integrity()):
        assert report["npu_blocks_used"] == 0 and report["num_unfinished"] == 0
