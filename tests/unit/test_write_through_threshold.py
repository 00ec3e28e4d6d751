"""``write_through_threshold`` reads alike on the command line, in YAML and in Python: 0
disables write-through, N copies a block to host at its N-th hit, ``immediate`` copies every
block when it is first written."""

import pytest
import yaml

from cluster.cli import build_config, build_parser
from cluster.config import ClusterConfig, ModelConfig
from cluster.llm import LLM
from replicas.config import KVOffloadConfig, SchedulerConfig
from replicas.sampling_params import SamplingParams

PROMPT = list(range(1, 3 * 16 + 2))  # three full blocks and one token

# value as written -> (the threshold the cache manager is given, write-through promotions
# counted after each of three runs of PROMPT: its first write, then two hits)
BEHAVIOUR = {
    "0": (None, [0, 0, 0]),
    "immediate": (0, [3, 3, 3]),
    "1": (1, [0, 3, 3]),
    "2": (2, [0, 0, 3]),
}
SURFACES = ["cli", "yaml", "python"]


def _python_value(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def config_of(surface: str, text: str, tmp_path) -> ClusterConfig:
    if surface == "cli":
        argv = [
            "generate",
            "tiny",
            "--num-npu-blocks",
            "32",
            "--experimental-kv-offload-host-memory-ratio",
            "1",
            "--experimental-kv-offload-write-through-threshold",
            text,
        ]
        return build_config(build_parser().parse_args(argv))
    if surface == "yaml":
        path = tmp_path / "threshold.yaml"
        path.write_text(
            "model:\n  model: tiny\n  num_npu_blocks: 32\n"
            "scheduler:\n  kv_offload_config:\n    enabled: true\n    host_memory_ratio: 1\n"
            f"    write_through_threshold: {text}\n"
        )
        return ClusterConfig.from_yaml(path)
    offload = KVOffloadConfig(
        enabled=True, host_memory_ratio=1.0, write_through_threshold=_python_value(text)
    )
    return ClusterConfig(
        model=ModelConfig(model="tiny", num_npu_blocks=32),
        scheduler=SchedulerConfig(kv_offload_config=offload),
    )


def promotions(llm: LLM) -> list[int]:
    counts = []
    for _ in range(3):
        llm.generate([PROMPT], SamplingParams(max_tokens=2))
        counts.append(llm.stats().cache.write_through_promotions)
    return counts


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize("text", list(BEHAVIOUR))
def test_each_surface_reads_the_threshold_alike(surface, text, tmp_path):
    offload = config_of(surface, text, tmp_path).scheduler.kv_offload_config
    assert offload.write_through_threshold == _python_value(text)


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize("text", list(BEHAVIOUR))
def test_each_surface_promotes_alike(surface, text, tmp_path):
    if surface == "python":
        offload = KVOffloadConfig(
            enabled=True, host_memory_ratio=1.0, write_through_threshold=_python_value(text)
        )
        llm = LLM(
            "tiny", num_npu_blocks=32, scheduler_config=SchedulerConfig(kv_offload_config=offload)
        )
    else:
        llm = LLM.from_config(config_of(surface, text, tmp_path))
    with llm:
        assert promotions(llm) == BEHAVIOUR[text][1]


def test_yaml_reads_immediate_and_zero_as_written():
    assert yaml.safe_load("t: immediate")["t"] == "immediate" and yaml.safe_load("t: 0")["t"] == 0


@pytest.mark.parametrize("off", [0, None])
def test_none_reads_as_zero_in_python(off):
    config = KVOffloadConfig(enabled=True, host_memory_ratio=1.0, write_through_threshold=off)
    assert config.write_through_threshold == 0


def test_the_description_says_every_value_once():
    text = KVOffloadConfig.model_fields["write_through_threshold"].description
    assert "0 disables" in text and "'immediate'" in text
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    [action] = [a for a in serve._actions if a.dest == "write_through_threshold"]
    assert "0 disables" in action.help and "'immediate'" in action.help
    assert serve.parse_args(["--experimental-kv-offload-write-through-threshold", "immediate"])
    with pytest.raises(SystemExit):
        serve.parse_args(["--experimental-kv-offload-write-through-threshold", "soon"])


def test_the_former_translation_still_reads_with_a_deprecation_warning():
    config = KVOffloadConfig(
        enabled=True, host_memory_ratio=1.0, write_through_threshold="immediate"
    )
    with pytest.warns(DeprecationWarning, match="promotion_threshold"):
        assert config.promotion_threshold == 0
    off = KVOffloadConfig(enabled=True, host_memory_ratio=1.0, write_through_threshold=0)
    with pytest.warns(DeprecationWarning):
        assert off.promotion_threshold is None
