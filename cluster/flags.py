"""The cluster flags of ``strata serve``, ``strata generate`` and ``python -m cluster.job``,
generated from the config models' fields: each option is declared once, in pydantic.

A flag sets one field of ``ClusterConfig``, named by its path (``"scheduler.max_num_seqs"``):

- name: ``--`` and the field's name in kebab case, after its section's prefix
  (``SECTION_PREFIXES``); ``FLAG_NAMES`` holds the few flags spelled otherwise, as the reference
  system spells them;
- help: the field's description and default; type or choices: the field's annotation (a
  ``Literal``'s values are listed and checked by the config, so a bad one fails in one sentence);
- a boolean is one switch that flips its default (``--experimental-kv-offload-write-back``,
  ``--no-enable-prefix-caching``); a field in bytes is given in GiB; a field that takes a list
  is a flag to repeat.

Every default is None on the parser, so only the flags given override the YAML config.
"""

import argparse
import math
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from cluster.config import ClusterConfig
from replicas.model.resolve import DEFAULT_MODEL


class Flag(NamedTuple):
    """One flag: the path of the field it sets and, where useful, its metavar."""

    path: str
    metavar: str | None = None


FLAG_GROUPS: dict[str, tuple[Flag, ...]] = {
    "deployment": (Flag("data_parallel_size", "N"),),
    "model": (
        Flag("model.model"),
        Flag("model.revision"),
        Flag("model.served_model_name", "NAME"),
        Flag("model.seed"),
        Flag("model.device"),
        Flag("model.dtype"),
        Flag("model.quantization"),
        Flag("model.decoder_stack"),
        Flag("model.int4_kernel"),
        Flag("model.torch_compile"),
        Flag("model.cuda_graphs"),
        Flag("model.max_model_len", "TOKENS"),
    ),
    "cache": (
        Flag("model.block_size", "TOKENS"),
        Flag("model.num_npu_blocks", "N"),
        Flag("model.npu_kv_memory_bytes", "GIB"),
        Flag("model.npu_kv_memory_fraction", "F"),
        Flag("model.kv_cache_dtype"),
        Flag("scheduler.prefix_cache_config.enabled"),
        Flag("scheduler.prefix_cache_config.reservation_share", "SHARE"),
    ),
    "scheduler": (
        Flag("scheduler.max_num_seqs", "N"),
        Flag("scheduler.max_num_batched_tokens", "TOKENS"),
        Flag("scheduler.speculative_ngram", "K"),
    ),
    "host tier": (
        Flag("scheduler.kv_offload_config.host_memory_bytes", "GIB"),
        Flag("scheduler.kv_offload_config.host_memory_ratio", "R"),
        Flag("scheduler.kv_offload_config.write_through_threshold", "HITS"),
        Flag("scheduler.kv_offload_config.write_back"),
        Flag("scheduler.kv_offload_config.retention"),
        Flag("scheduler.kv_offload_config.retained_share", "S"),
        Flag("scheduler.kv_offload_config.retained_priority", "{decay,pin}"),
        Flag("scheduler.kv_offload_config.disk_path", "DIR"),
        Flag("scheduler.kv_offload_config.disk_bytes", "GIB"),
    ),
    "routing": (
        Flag("routing.policy"),
        Flag("routing.scoring_profile"),
        Flag("routing.prefix_weight", "W"),
        Flag("routing.load_weight", "W"),
        Flag("routing.host_hit_weight", "W"),
        Flag("routing.disk_hit_weight", "W"),
    ),
    "server": (Flag("server.host"), Flag("server.port"), Flag("server.api_key", "KEY")),
    "scaling": tuple(
        Flag(f"scaling.{name}", metavar)
        for name, metavar in (
            ("min_replicas", "N"),
            ("max_replicas", "N"),
            ("target_queue_s", "S"),
            ("downscale_queue_fraction", "F"),
            ("metrics_interval_s", "S"),
            ("look_back_period_s", "S"),
            ("upscale_delay_s", "S"),
            ("downscale_delay_s", "S"),
            ("upscaling_factor", "F"),
            ("downscaling_factor", "F"),
            ("cooldown_s", "S"),
        )
    ),
    "Ray": (
        Flag("ray.address"),
        Flag("ray.num_cpus", "CPUS"),
        Flag("ray.cpus_per_replica", "CPUS"),
        Flag("ray.gpus_per_replica", "GPUS"),
    ),
}
"""The argument groups of the cluster flags, in the order ``--help`` lists them."""

GROUP_DESCRIPTIONS = {
    "host tier": "A capacity flag turns the host tier on (a ratio of 0 leaves it off); the "
    "other flags of this group need one.",
    "scaling": "Any flag of this group turns the autoscaling policy on (cluster.autoscale); "
    "names follow Ray Serve's autoscaling_config.",
}

SECTION_PREFIXES = {
    "scheduler.kv_offload_config.": "--experimental-kv-offload-",
    "routing.": "--data-parallel-",
    "scaling.": "--scaling-",
}
"""The name of a field's flag in these sections starts with the section's prefix."""

FLAG_NAMES: dict[str, tuple[str, ...]] = {
    "data_parallel_size": ("--data-parallel-size", "-dp"),
    "model.model": ("model",),  # positional
    "scheduler.prefix_cache_config.enabled": ("--no-enable-prefix-caching",),
    "model.cuda_graphs": ("--enforce-eager",),
    "scheduler.prefix_cache_config.reservation_share": ("--prefix-reservation-share",),
    "scheduler.kv_offload_config.host_memory_bytes": ("--experimental-kv-offload-host-memory-gb",),
    "scheduler.kv_offload_config.disk_bytes": ("--experimental-kv-offload-disk-gb",),
    "model.npu_kv_memory_bytes": ("--npu-kv-memory-gb",),
    "routing.policy": ("--data-parallel-routing-policy",),
}
"""The flags whose name is not the rule's (the reference system's spellings)."""

DEFAULT_TEXTS = {"model.model": f"the config's model, else {DEFAULT_MODEL}"}
"""Defaults the command line fills in itself, where they differ from the field's."""


def gib(text: str) -> int:
    """A GiB amount on the command line, in bytes."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return int(value * 2**30)


def add_flag_groups(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """One argument group of ``parser`` per key of ``FLAG_GROUPS``, in order, by title."""
    return {
        title: parser.add_argument_group(title, GROUP_DESCRIPTIONS.get(title))
        for title in FLAG_GROUPS
    }


def add_config_flags(groups: dict[str, argparse._ArgumentGroup]) -> None:
    """Add every flag of ``FLAG_GROUPS`` to its group (``add_flag_groups``)."""
    for title, flags in FLAG_GROUPS.items():
        for flag in flags:
            names, options = flag_argument(flag)
            groups[title].add_argument(*names, **options)


def flag_argument(flag: Flag) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The option strings and ``add_argument`` keywords of ``flag``."""
    field = config_field(flag.path)
    leaf = flag.path.rsplit(".", 1)[-1]
    names = FLAG_NAMES.get(flag.path) or (_flag_name(flag.path),)
    options: dict[str, Any] = {"default": None, "help": flag_help(flag.path, field)}
    if names[0].startswith("-"):
        options["dest"] = leaf
    else:
        options["nargs"] = "?"
    kinds = _annotation_kinds(field.annotation)
    words = [word for kind in kinds if typing.get_origin(kind) is Literal for word in kind.__args__]
    if bool in kinds:
        return names, options | {"action": "store_const", "const": not field.default}
    if any(typing.get_origin(kind) is list for kind in kinds):
        options["action"] = "append"
    elif leaf.endswith("_bytes"):
        options["type"] = gib
    elif int in kinds or float in kinds:
        options["type"] = _number_or_word(int if int in kinds else float, words)
    options["metavar"] = flag.metavar or ("{" + ",".join(words) + "}" if words else None)
    return names, options


def flag_help(path: str, field: FieldInfo) -> str:
    """The help of a field's flag: its description (less a leading ``--flag:``) and default."""
    description = field.description or ""
    if description.startswith("--"):
        description = description.split(": ", 1)[-1]
        description = description[:1].upper() + description[1:]
    kinds = _annotation_kinds(field.annotation)
    if bool in kinds:
        state, flipped = ("on", "off") if field.default else ("off", "on")
        return f"{description} Default: {state}; this flag turns it {flipped}.".replace("%", "%%")
    if path.endswith("_bytes"):
        description += " On the command line: in GiB."
    if any(typing.get_origin(kind) is list for kind in kinds):
        description += " Repeat the flag for several."
    default = DEFAULT_TEXTS.get(path)
    if default is None:
        value = field.get_default(call_default_factory=True)
        default = "none" if value is None else str(value)
    return f"{description} Default: {default}.".replace("%", "%%")


def flag_values(args: argparse.Namespace) -> dict[str, object]:
    """The fields the flags given set, by path: a repeated flag given once sets one value."""
    values: dict[str, object] = {}
    for flags in FLAG_GROUPS.values():
        for flag in flags:
            value = getattr(args, flag.path.rsplit(".", 1)[-1])
            if isinstance(value, list) and len(value) == 1:
                value = value[0]
            if value is not None:
                values[flag.path] = value
    return values


def config_field(path: str, model: type[BaseModel] = ClusterConfig) -> FieldInfo:
    """The field of ``model`` at ``path`` (dotted: sections, then the field)."""
    *sections, name = path.split(".")
    for section in sections:
        (model,) = _annotation_kinds(model.model_fields[section].annotation)  # less a None
    return model.model_fields[name]


def _flag_name(path: str) -> str:
    for section, prefix in SECTION_PREFIXES.items():
        if path.startswith(section):
            return prefix + path.removeprefix(section).replace("_", "-")
    return "--" + path.rsplit(".", 1)[-1].replace("_", "-")


def _annotation_kinds(annotation: object) -> list[object]:
    """The members of a field's annotation, less ``None``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [kind for kind in typing.get_args(annotation) if kind is not type(None)]
    return [annotation]


def _number_or_word(kind: type, words: list[str]) -> Callable[[str], object]:
    """Parse a number of ``kind``, or one of ``words`` as given."""
    if not words:
        return kind

    def parse(text: str) -> object:
        return text if text in words else kind(text)

    parse.__name__ = kind.__name__  # argparse's error names the type: "invalid int value"
    return parse
