"""Stored responses: what ``GET /v1/responses/{id}`` reads and ``previous_response_id`` continues.

Each entry belongs to the API key that created it (its ``owner``); another key neither reads nor
deletes it (it is "not found"). Without keys every request has the same owner.

Bounds, over all owners together::

    oldest ----------------------------------------------------------------> newest
    [expired: older than ttl_s] [evicted while over max_responses or max_bytes] [kept]

Entries leave in the order they were stored: an entry older than ``ttl_s`` is dropped, and
while the store holds more than ``max_responses`` entries or ``max_bytes`` bytes the oldest
goes. An entry larger than ``max_bytes`` alone is not stored. ``num_bytes`` counts what an
entry holds (its JSON and its token ids at 4 bytes each), not Python's object overhead.

Each entry holds its whole conversation (and the token ids of its last turn), so that it
continues without its predecessors: a long conversation costs its length per stored turn, which
``max_bytes`` bounds; a client that keeps only the last turn may delete the earlier ones.
"""

import json
import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.config import ResponseStoreConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StoredResponse:
    """A finished response and what continuing its conversation needs.

    ``messages`` are the conversation in chat shape without the instructions: the input
    (after the previous responses' conversation) and then this response's output.
    ``prompt_token_ids`` and ``output_token_ids`` are exactly what the model read and wrote,
    so that the next turn's prompt can start with them and reuse their cached KV."""

    response_id: str
    body: bytes  # the ResponseObject as JSON
    instructions: str | None
    num_input_messages: int  # messages[:num_input_messages] were the prompt's, after instructions
    messages_json: bytes
    prompt_token_ids: array
    output_token_ids: array
    created_s: float = 0.0
    num_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_bytes = (
            len(self.body)
            + len(self.messages_json)
            + self.prompt_token_ids.itemsize * len(self.prompt_token_ids)
            + self.output_token_ids.itemsize * len(self.output_token_ids)
        )

    @classmethod
    def build(
        cls,
        response_id: str,
        body: bytes,
        instructions: str | None,
        input_messages: list[dict[str, Any]],
        output_messages: list[dict[str, Any]],
        prompt_token_ids: list[int],
        output_token_ids: list[int],
    ) -> "StoredResponse":
        return cls(
            response_id,
            body,
            instructions,
            len(input_messages),
            json.dumps(input_messages + output_messages, ensure_ascii=False).encode(),
            array("i", prompt_token_ids),
            array("i", output_token_ids),
        )

    @property
    def messages(self) -> list[dict[str, Any]]:
        return json.loads(self.messages_json)


class ResponseStore:
    """Owner-partitioned, bounded, expiring map of response id -> ``StoredResponse``. Not
    thread-safe: the HTTP app uses it from its one event loop."""

    def __init__(
        self, config: ResponseStoreConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, owner: str, entry: StoredResponse) -> bool:
        """Store ``entry`` (replacing one of the same id); False when it alone is too large."""
        self._expire()
        if self.config.max_responses == 0:
            return False  # storing is turned off
        if entry.num_bytes > self.config.max_bytes:
            logger.warning(
                "response %s (%d bytes) is not stored: the store holds at most %d bytes",
                entry.response_id,
                entry.num_bytes,
                self.config.max_bytes,
            )
            return False
        self.delete(owner, entry.response_id)
        entry.created_s = self._clock()
        self._entries[owner, entry.response_id] = entry
        self.num_bytes += entry.num_bytes
        while (
            len(self._entries) > self.config.max_responses or self.num_bytes > self.config.max_bytes
        ):
            self._pop_oldest()
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get((owner, response_id))

    def delete(self, owner: str, response_id: str) -> bool:
        entry = self._entries.pop((owner, response_id), None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True

    def ids(self, owner: str) -> list[str]:
        """The owner's stored response ids, oldest first."""
        self._expire()
        return [response_id for (o, response_id) in self._entries if o == owner]

    def _expire(self) -> None:
        deadline = self._clock() - self.config.ttl_s
        while self._entries and next(iter(self._entries.values())).created_s <= deadline:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.num_bytes -= entry.num_bytes

    def check_integrity(self) -> None:
        assert self.num_bytes == sum(e.num_bytes for e in self._entries.values())
        assert len(self._entries) <= self.config.max_responses
        assert self.num_bytes <= self.config.max_bytes
        times = [e.created_s for e in self._entries.values()]
        assert times == sorted(times), "entries are kept in the order they were stored"
