"""A replica actor on a Ray placement bundle: with ``device: auto`` it runs on the GPU its bundle
reserves (``ray.gpus_per_replica``), and on the CPU when its bundle reserves none, also on a
machine with a GPU (Ray leaves that GPU visible to actors that did not ask for it)."""

import asyncio

import pytest
import torch

from cluster import LLM, KVOffloadConfig, SamplingParams, SchedulerConfig
from tests.gpu.devices import CUDA

ray = pytest.importorskip("ray", reason="Ray is not installed: replica placement is not checked")

from cluster.config import ClusterConfig, ModelConfig, RayConfig  # noqa: E402  (needs Ray)
from cluster.deploy import RayBackend  # noqa: E402
from replicas.kv.events import Tier  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPT = [(7 * i) % 256 for i in range(100)]


@pytest.fixture(scope="module")
def ray_instance():
    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local",
            num_cpus=2,
            # Without a GPU, one declared anyway: placement logic is checked, CUDA is not used.
            num_gpus=max(1, torch.cuda.device_count() if torch.cuda.is_available() else 0),
            include_dashboard=False,
            namespace="strata-gpu-tests",
            log_to_driver=False,
        )
    yield ray
    if started:
        ray.shutdown()


async def generate(backend: RayBackend, request_id: str, tokens: list[int]):
    final = None
    async for output in backend.generate(request_id, tokens, GREEDY):
        final = output
    return final


@pytest.mark.parametrize(
    ("gpus_per_replica", "device"),
    [
        pytest.param(0, "cpu", id="cpu-bundle"),
        pytest.param(0, "cpu", id="cpu-bundle-on-a-gpu-machine", marks=CUDA),
        pytest.param(1, "cuda", id="gpu-bundle", marks=CUDA),
    ],
)
def test_replica_device_follows_its_placement_bundle(ray_instance, gpus_per_replica, device):
    scheduler = SchedulerConfig(
        kv_offload_config=KVOffloadConfig(
            enabled=True, host_memory_ratio=2.0, write_through_threshold="immediate"
        )
    )
    config = ClusterConfig(
        model=ModelConfig(model="tiny", num_npu_blocks=64),
        scheduler=scheduler,
        ray=RayConfig(cpus_per_replica=0.5, gpus_per_replica=gpus_per_replica),
    )
    backend = RayBackend(config, name=f"placed-{gpus_per_replica}-{device}")
    try:
        assert backend.replica_infos[0]["device"] == device
        first = asyncio.run(generate(backend, "first", PROMPT))
        local = LLM("tiny", device=device, num_npu_blocks=64, scheduler_config=scheduler)
        assert first.finished and first.token_ids == local.generate(PROMPT, GREEDY).token_ids
        asyncio.run(backend.check_integrity())  # between the two: the first one's stores landed
        ray.get(backend.replicas[0].reset_prefix_cache.remote("npu"))
        again = asyncio.run(generate(backend, "again", [*PROMPT[:96], 1, 2, 3]))
        assert again.num_cached_tokens_in(Tier.HOST) == 96  # reloaded from the host tier
        stats = ray.get(backend.replicas[0].stats.remote())
        assert stats.transfer.blocks_loaded == 6 and stats.transfer.blocks_stored >= 6
        asyncio.run(backend.check_integrity())
    finally:
        backend.shutdown()


def test_auto_device_is_cuda_exactly_when_the_bundle_reserves_a_gpu(ray_instance):
    if not ray.cluster_resources().get("GPU"):
        pytest.skip("this Ray instance declares no GPU")

    @ray.remote(num_cpus=0)
    def placed() -> tuple[str, str, str]:
        from replicas.actor import placed_device

        return placed_device("auto"), placed_device("cpu"), placed_device("cuda")

    assert ray.get(placed.options(num_gpus=1).remote()) == ("cuda", "cpu", "cuda")
    assert ray.get(placed.options(num_gpus=0).remote()) == ("cpu", "cpu", "cuda")
