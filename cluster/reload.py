"""``strata serve --config FILE`` re-reads FILE on SIGHUP.

    SIGHUP -> read FILE (flags given on the command line still override it) -> compare:
        nothing changed                -> logged; nothing changes
        data_parallel_size changed     -> the deployment is resized (``Backend.scale``)
        any other field changed        -> named in one log line as needing a restart
        FILE invalid, or a bad size    -> logged naming why; nothing changes

Only the size is applied live: every other field shapes replicas, the router or the server
when they start.
"""

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any, NamedTuple

from pydantic import ValidationError

from cluster.backend import Backend
from cluster.config import ClusterConfig

logger = logging.getLogger(__name__)


class ReloadPlan(NamedTuple):
    """What a re-read config changes: the new size (None: unchanged) and the dotted names of
    the other changed fields (they need a restart)."""

    data_parallel_size: int | None
    needs_restart: list[str]

    @property
    def is_empty(self) -> bool:
        return self.data_parallel_size is None and not self.needs_restart


def plan_reload(current: ClusterConfig, new: ClusterConfig) -> ReloadPlan:
    """Compare the config in effect with a re-read one (pure)."""
    before, after = _flatten(current.model_dump()), _flatten(new.model_dump())
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    size = new.data_parallel_size if "data_parallel_size" in changed else None
    return ReloadPlan(size, [k for k in changed if k != "data_parallel_size"])


async def reload_config(
    backend: Backend, current: ClusterConfig, read: Callable[[], ClusterConfig]
) -> ClusterConfig:
    """Re-read the config with ``read`` and apply what can be applied live (the module
    docstring); the config in effect afterwards. Never raises for a bad file or size."""
    try:
        new = read()
    except (OSError, ValueError, ValidationError) as error:
        logger.error("SIGHUP: the config was not reloaded, nothing changed: %s", _one_line(error))
        return current
    plan = plan_reload(current, new)
    if plan.is_empty:
        logger.info("SIGHUP: the config is unchanged; nothing to do")
        return current
    if plan.needs_restart:
        logger.warning(
            "SIGHUP: these changed fields take effect only after a restart: %s",
            ", ".join(plan.needs_restart),
        )
    if plan.data_parallel_size is None:
        return current
    try:
        result = await backend.scale(plan.data_parallel_size)
    except Exception as error:  # a bad size or a deployment that cannot resize: logged
        logger.error(
            "SIGHUP: data_parallel_size %d not applied, nothing changed: %s",
            plan.data_parallel_size,
            error,
        )
        return current
    logger.info("SIGHUP: resized: %s", result.as_dict())
    return current.model_copy(update={"data_parallel_size": plan.data_parallel_size})


def watch_sighup(
    loop: asyncio.AbstractEventLoop,
    backend: Backend,
    config: ClusterConfig,
    read: Callable[[], ClusterConfig],
) -> None:
    """Reload on every SIGHUP, one reload at a time, on ``loop`` (the serving loop)."""
    state = {"config": config}
    lock = asyncio.Lock()

    async def reload() -> None:
        async with lock:
            state["config"] = await reload_config(backend, state["config"], read)

    tasks: set[asyncio.Task] = set()  # kept until done (the loop keeps weak references)

    def on_signal() -> None:
        task = loop.create_task(reload())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    loop.add_signal_handler(signal.SIGHUP, on_signal)


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _one_line(error: Exception) -> str:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{where}: {str(first['msg']).removeprefix('Value error, ')}"
    return str(error)
