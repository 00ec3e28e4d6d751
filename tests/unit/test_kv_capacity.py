"""The host tier's sizing rules, one home for the engine, the deployment and the simulator."""

import pytest
import torch

from replicas.config import EngineConfig
from replicas.dtypes import TORCH_DTYPES, torch_dtype
from replicas.kv.capacity import host_blocks_per_replica, replica_host_bytes
from replicas.prompt import check_prompt_length


def test_dtype_table_gives_torch_dtypes_and_their_bytes():
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert {name: d.itemsize for name, d in TORCH_DTYPES.items()} == {
        "float32": 4,
        "bfloat16": 2,
        "float16": 2,
    }
    with pytest.raises(ValueError, match="dtype must be float32, bfloat16 or float16, got 'int8'"):
        torch_dtype("int8")
    with pytest.raises(ValueError, match="dtype must be"):
        EngineConfig(dtype="float64")


def test_replica_share_of_a_byte_budget():
    assert replica_host_bytes(10 * 1000 + 7, 3, 1000) == 3335
    with pytest.raises(ValueError, match=r"gives each of the 4 replicas 750 bytes, less than one"):
        replica_host_bytes(3000, 4, 1000)


@pytest.mark.parametrize(
    ("gib", "ratio", "dp", "expected"),
    [
        (0.0, 0.0, 8, 0),  # no host tier
        (0.0, 2.5, 8, 250),  # floor(2.5 x 100), whatever dp
        (0.0, 0.017, 1, 1),
        (1.0, 0.0, 1, 8192),  # 2**30 / 131072
        (1.0, 0.0, 3, 2730),  # floor(2**30 / 3 / 131072)
        (1024.0, 0.0, 8, 1048576),
    ],
)
def test_host_blocks_per_replica(gib, ratio, dp, expected):
    kwargs = {"host_memory_gib": gib, "host_memory_ratio": ratio}
    assert host_blocks_per_replica(100, 131072.0, dp, **kwargs) == expected


def test_host_blocks_per_replica_takes_fractional_block_bytes():
    # 357913941.33 bytes per replica (2**30 / 3) over blocks of 1000.5 bytes (scaled tokens).
    assert host_blocks_per_replica(10, 1000.5, 3, host_memory_gib=1.0) == int((2**30 / 3) // 1000.5)


def test_host_blocks_per_replica_errors_name_the_caller_options():
    options = {"gib_option": "--host-memory-gb", "ratio_option": "--host-memory-ratio"}
    with pytest.raises(ValueError, match="--host-memory-gb and --host-memory-ratio are mutually"):
        host_blocks_per_replica(10, 4096.0, 1, host_memory_gib=1, host_memory_ratio=1, **options)
    with pytest.raises(ValueError, match="--host-memory-gb gives each of the 8 replicas"):
        host_blocks_per_replica(10, 2.0**30, 8, host_memory_gib=1.0, **options)


def test_prompt_must_leave_room_for_one_output_token():
    check_prompt_length(99, 100)
    with pytest.raises(
        ValueError,
        match="the prompt has 100 tokens but max_model_len is 100: it must be shorter, "
        "leaving room for one output token",
    ):
        check_prompt_length(100, 100)
