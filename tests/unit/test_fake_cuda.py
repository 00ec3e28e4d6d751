"""The fake CUDA device (``replicas.fake_cuda``): tensors made for ``cuda`` report it, compute
what the CPU computes, and raise on the device mixes a GPU refuses."""

import pytest
import torch
import torch.nn.functional as F

from replicas import fake_cuda
from replicas.engine.engine import resolve_device
from replicas.fake_cuda import FakeCudaTensor

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device is here")
MISMATCH = "Expected all tensors to be on the same device"


@pytest.fixture
def fake():
    with fake_cuda.activated():
        yield


def test_tensors_made_for_cuda_report_it_and_hold_the_cpu_values(fake):
    made = [
        torch.tensor([1.5, 2.5], device="cuda"),
        torch.zeros(3, device="cuda:0"),
        torch.arange(5, device=torch.device("cuda")),
        torch.full((2,), 7, device="cuda"),
        torch.ones(4).to("cuda"),
        torch.ones(4).cuda(),
        torch.empty(2, 3, device="cuda").new_zeros(3),
        torch.zeros(1).new_ones(2, device="cuda"),
    ]
    for t in made:
        assert t.device == torch.device("cuda", 0) and t.is_cuda and not t.is_cpu
        assert isinstance(t, FakeCudaTensor)
    assert made[0].tolist() == [1.5, 2.5] and made[2][3].item() == 3
    assert torch.equal(made[3].cpu(), torch.full((2,), 7))
    x = torch.randn(4, 5)
    y = (x.cuda() @ torch.ones(5, 2, device="cuda")).softmax(-1)
    assert y.device.type == "cuda" and torch.equal(y.cpu(), (x @ torch.ones(5, 2)).softmax(-1))


def test_cpu_copies_are_plain_independent_tensors(fake):
    x = torch.ones(3, device="cuda")
    for host in (x.cpu(), x.to("cpu"), x.to(torch.zeros(1)), x.to(device="cpu", dtype=torch.int64)):
        assert type(host) is torch.Tensor and host.device.type == "cpu"
    host = x.cpu()
    x.add_(1)
    assert host.tolist() == [1.0, 1.0, 1.0] and x.tolist() == [2.0, 2.0, 2.0]
    assert x.to("cuda") is x and x.to(torch.float64).dtype == torch.float64


def test_mixing_cuda_and_cpu_tensors_raises_as_on_a_gpu(fake):
    x = torch.randn(4, device="cuda")
    cpu = torch.randn(4)
    rows = torch.randn(2, 4, device="cuda")
    refused = [
        lambda: x + cpu,
        lambda: cpu * x,
        lambda: torch.cat([x, cpu]),
        lambda: torch.where(x > 0, x, cpu),
        lambda: rows.gather(1, torch.tensor([[0], [1]])),  # the bug of the old _logprobs
        lambda: x.index_select(0, torch.tensor([1])),
        lambda: F.linear(cpu, rows),
        lambda: rows.__setitem__(torch.tensor([0]), torch.ones(1, 4)),
        lambda: cpu[torch.tensor([0], device="cuda")],
    ]
    for call in refused:
        with pytest.raises(RuntimeError, match=MISMATCH + "|indices should be"):
            call()


def test_the_mixes_a_gpu_accepts_are_accepted(fake):
    x = torch.arange(6.0, device="cuda")
    assert (x * torch.tensor(2.0)).tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]  # a CPU scalar
    assert x[torch.tensor([1, 3])].tolist() == [1.0, 3.0]  # CPU indices
    x[[0, 1]] = float("-inf")
    x[2:4] = torch.tensor([9.0, 8.0])  # a copy
    x.copy_(x.cpu() + 1)
    assert x.tolist() == [float("-inf"), float("-inf"), 10.0, 9.0, 5.0, 6.0]
    host = torch.zeros(6)
    host.copy_(x)
    assert type(host) is torch.Tensor and host[2].item() == 10.0


def test_a_generator_is_on_the_device_of_what_it_draws_and_draws_what_the_cpu_draws(fake):
    probs = torch.softmax(torch.randn(50), -1)
    on_cuda = torch.Generator(device="cuda").manual_seed(3)
    assert on_cuda.device.type == "cuda" and isinstance(on_cuda, torch.Generator)
    drawn = torch.multinomial(probs.cuda(), 4, generator=on_cuda)
    expected = torch.multinomial(probs, 4, generator=torch.Generator().manual_seed(3))
    assert drawn.device.type == "cuda" and torch.equal(drawn.cpu(), expected)
    with pytest.raises(RuntimeError, match="'cuda' device type for generator"):
        torch.multinomial(probs.cuda(), 1, generator=torch.Generator().manual_seed(0))


def test_modules_moved_to_cuda_keep_parameters_and_refuse_cpu_inputs(fake):
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    x = torch.randn(5, 3)
    expected = layer(x)
    layer.to("cuda")
    assert all(p.device.type == "cuda" for p in layer.parameters())
    assert all(isinstance(p, torch.nn.Parameter) for p in layer.parameters())
    assert torch.equal(layer(x.cuda()).cpu(), expected)
    with pytest.raises(RuntimeError, match=MISMATCH):
        layer(x)


def test_host_memory_is_never_pinned_and_cuda_tensors_refuse_numpy_and_pinning(fake):
    host = torch.empty(4, pin_memory=True)
    assert host.device.type == "cpu" and not host.is_pinned()
    assert torch.ones(2).pin_memory().tolist() == [1.0, 1.0]
    x = torch.ones(2, device="cuda")
    with pytest.raises(TypeError, match="can't convert cuda"):
        x.numpy()
    with pytest.raises(RuntimeError, match="cannot pin"):
        x.pin_memory()


def test_the_cuda_runtime_says_one_device_with_complete_streams(fake):
    assert torch.cuda.is_available() and torch.cuda.device_count() == 1
    free, total = torch.cuda.mem_get_info()
    assert 0 < free <= total == torch.cuda.get_device_properties(0).total_memory
    stream = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    with torch.cuda.stream(stream):
        assert torch.cuda.current_stream() is stream
        end.record(stream)
    assert torch.cuda.current_stream() is not stream
    stream.wait_stream(torch.cuda.current_stream())
    end.synchronize()
    assert end.query() and start.elapsed_time(end) >= 0.0
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="is_active"):
        torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.zeros(1, device="cuda:1")


def test_deactivate_restores_torch():
    real = torch.cuda.is_available()
    zeros = torch.zeros
    with fake_cuda.activated():
        assert fake_cuda.is_active() and torch.zeros is not zeros
        kept = torch.ones(1, device="cuda")
    assert not fake_cuda.is_active() and torch.zeros is zeros
    assert torch.cuda.is_available() == real
    assert kept.device.type == "cuda"  # made before: still reports its device


def test_the_engine_turns_the_fake_device_on_only_when_asked(monkeypatch):
    monkeypatch.delenv(fake_cuda.ENV, raising=False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")
    assert not fake_cuda.is_active()
    monkeypatch.setenv(fake_cuda.ENV, "1")
    try:
        assert resolve_device("cpu").type == "cpu" and not fake_cuda.is_active()
        assert resolve_device("cuda").type == "cuda" and fake_cuda.is_active()
    finally:
        fake_cuda.deactivate()
