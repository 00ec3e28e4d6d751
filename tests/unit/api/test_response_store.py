"""The stored responses: per-owner, bounded in count and bytes, expiring, oldest out first."""

import pytest

from cluster.api.responses.store import ResponseStore, ResponseStoreConfig, StoredResponse


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def entry(response_id: str, num_tokens: int = 10, body: bytes = b"{}") -> StoredResponse:
    messages = [{"role": "user", "content": "hi"}]
    output = [{"role": "assistant", "content": "yo"}]
    return StoredResponse.build(
        response_id, body, None, messages, output, list(range(num_tokens)), [7, 8]
    )


def make(max_responses: int = 8, max_bytes: int = 10_000, ttl_s: float = 60.0):
    clock = Clock()
    config = ResponseStoreConfig(max_responses=max_responses, max_bytes=max_bytes, ttl_s=ttl_s)
    return ResponseStore(config, clock), clock


def test_an_entry_counts_its_json_and_token_ids():
    stored = entry("a", num_tokens=10, body=b"x" * 5)
    messages_json = b'[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]'
    assert stored.messages_json == messages_json
    assert stored.num_bytes == 5 + len(messages_json) + 4 * 10 + 4 * 2
    assert stored.num_input_messages == 1
    assert stored.messages[1] == {"role": "assistant", "content": "yo"}


def test_owners_do_not_see_each_others_entries():
    store, _ = make()
    assert store.put("k1", entry("a"))
    assert store.get("k1", "a") is not None
    assert store.get("k2", "a") is None
    assert not store.delete("k2", "a")
    assert store.ids("k1") == ["a"] and store.ids("k2") == []
    assert store.delete("k1", "a")
    assert store.get("k1", "a") is None and len(store) == 0 and store.num_bytes == 0
    store.check_integrity()


def test_the_oldest_entries_go_first_over_the_count_bound():
    store, clock = make(max_responses=3)
    for name in "abcde":
        clock.now += 1
        store.put("k", entry(name))
        store.check_integrity()
    assert store.ids("k") == ["c", "d", "e"]


def test_the_oldest_entries_go_first_over_the_byte_bound():
    one = entry("x").num_bytes
    store, _ = make(max_bytes=2 * one + one // 2)
    store.put("k1", entry("a"))
    store.put("k2", entry("b"))
    store.put("k1", entry("c"))  # a third does not fit: the oldest (another owner's too) goes
    assert store.ids("k1") == ["c"] and store.ids("k2") == ["b"]
    assert store.num_bytes == 2 * one
    store.check_integrity()


def test_an_entry_larger_than_the_store_is_not_kept():
    store, _ = make(max_bytes=200)
    store.put("k", entry("small", num_tokens=1))
    assert not store.put("k", entry("big", num_tokens=100))
    assert store.ids("k") == ["small"]
    nothing, _ = make(max_responses=0)
    assert not nothing.put("k", entry("a")) and len(nothing) == 0


def test_entries_expire_after_the_ttl():
    store, clock = make(ttl_s=60)
    store.put("k", entry("a"))
    clock.now += 30
    store.put("k", entry("b"))
    clock.now += 29.5
    assert store.ids("k") == ["a", "b"]
    clock.now += 1  # a is 60.5 s old, b 30.5 s
    assert store.get("k", "a") is None
    assert store.get("k", "b") is not None
    clock.now += 30
    assert store.ids("k") == [] and store.num_bytes == 0
    store.check_integrity()


def test_storing_an_id_again_replaces_it_and_renews_it():
    store, clock = make(ttl_s=60)
    store.put("k", entry("a", num_tokens=5))
    store.put("k", entry("b"))
    clock.now += 50
    store.put("k", entry("a", num_tokens=20))
    assert store.ids("k") == ["b", "a"]
    assert len(store.get("k", "a").prompt_token_ids) == 20
    clock.now += 20  # b expired, the new a did not
    assert store.ids("k") == ["a"]
    store.check_integrity()


@pytest.mark.parametrize(
    "field, value",
    [("max_responses", -1), ("max_bytes", -1), ("ttl_s", 0)],
)
def test_bounds_are_checked(field, value):
    with pytest.raises(ValueError):
        ResponseStoreConfig(**{field: value})


def test_the_server_config_takes_several_keys_and_the_store_bounds():
    from cluster import cli
    from cluster.config import ServerConfig

    server = ServerConfig(api_key=["a", "b"], responses={"max_responses": 3, "ttl_s": 5})
    assert server.api_key == ["a", "b"] and server.responses.max_responses == 3
    assert ServerConfig(api_key="a").api_key == "a"
    for bad in ([], [""], ""):
        with pytest.raises(ValueError, match="api_key"):
            ServerConfig(api_key=bad)
    parser = cli.build_parser()
    one = cli.build_config(parser.parse_args(["serve", "--api-key", "a"]))
    two = cli.build_config(parser.parse_args(["serve", "--api-key", "a", "--api-key", "b"]))
    assert one.server.api_key == "a" and two.server.api_key == ["a", "b"]
