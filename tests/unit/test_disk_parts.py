"""The disk tier's pieces alone (``replicas.kv.disk``): the record format, the slab file's
writes and validated reads, the own slot index with LRU and retention, the peers' slabs, the
hotness ranking and the change log. The store as a whole: test_disk_tier.py."""

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from replicas.kv.disk import peers as peers_module
from replicas.kv.disk.changes import ChangeLog
from replicas.kv.disk.peers import PEER_REFRESH_S, PeerSlabs
from replicas.kv.disk.ranking import HeatRanking
from replicas.kv.disk.record import (
    RECORD,
    Heat,
    Location,
    Recovered,
    checksum,
    pack_record,
    parse_index,
    parse_record,
    slab_number,
    slab_path,
)
from replicas.kv.disk.slab import SlabFile
from replicas.kv.disk.slots import OwnSlots
from replicas.kv.hotness import HIT_HALF_LIFE_S


def key(char: str) -> bytes:
    return char.encode() * 16


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---- the record format -----------------------------------------------------------------------
def test_a_record_reads_back_and_a_foreign_or_short_one_is_none():
    data = pack_record(7, key("a"), 1234, 64, Heat(2.5, 10.0))
    assert len(data) == RECORD.size
    assert parse_record(data) == (7, key("a"), 1234, 64, Heat(2.5, 10.0))
    assert parse_record(b"XXXX" + data[4:]) is None  # another magic
    assert parse_record(data[:-1]) is None
    assert parse_record(bytes(RECORD.size)) is None  # a zeroed slot
    index = data + bytes(RECORD.size) + data[:10]  # a torn last record is no slot
    assert [r and r.generation for r in parse_index(index)] == [7, None]


def test_the_checksum_covers_the_directory_seed_and_the_key():
    payload = bytes(range(32))
    assert checksum(1, key("a"), payload) != checksum(2, key("a"), payload)
    assert checksum(1, key("a"), payload) != checksum(1, key("b"), payload)


def test_only_index_file_names_give_a_slab_number():
    assert [slab_number(n) for n in ("slab-3.idx", "slab-3.kv", "slab-x.idx", "a.idx")] == [
        3,
        None,
        None,
        None,
    ]
    assert slab_path("d", 3, "kv") == os.path.join("d", "slab-3.kv")


# ---- the slab file ---------------------------------------------------------------------------
def slab_file(path, num_slots: int = 4) -> SlabFile:
    file = SlabFile(str(path), seed=9, block_bytes=16, num_slots=num_slots)
    file.open()
    file.allocate()
    return file


def test_a_written_block_reads_back_and_a_torn_one_is_a_miss(tmp_path):
    file = slab_file(tmp_path)
    block = torch.arange(4, dtype=torch.float32)
    file.write(1, key("a"), 5, block, Heat(1.0, 2.0))
    out = torch.zeros(4)
    assert file.read(Location(file.slab, 1, -1), key("a"), out) and torch.equal(out, block)
    assert not file.read(Location(file.slab, 1, 4), key("a"), out)  # another generation
    assert not file.read(Location(file.slab, 1, -1), key("b"), out)  # another key
    with open(slab_path(str(tmp_path), file.slab, "kv"), "r+b") as payload:
        payload.seek(16 + 3)
        payload.write(b"\xff")  # a torn payload: the checksum fails
    assert not file.read(Location(file.slab, 1, -1), key("a"), out)
    counts = file.counts()
    assert (counts.blocks_written, counts.blocks_read, counts.read_failures) == (1, 1, 3)
    file.close()


def test_a_heat_rewrite_keeps_the_block_and_a_cleared_slot_is_a_miss(tmp_path):
    file = slab_file(tmp_path)
    file.write(0, key("a"), 1, torch.ones(4), Heat(1.0, 2.0))
    file.write_heat(0, key("a"), Heat(8.0, 3.0))
    file.write_heat(0, key("b"), Heat(9.0, 4.0))  # not the slot's key: unchanged
    with open(slab_path(str(tmp_path), file.slab, "idx"), "rb") as index:
        assert next(parse_index(index.read())).heat == Heat(8.0, 3.0)
    assert file.read(Location(file.slab, 0, 1), key("a"), torch.zeros(4))
    file.clear(0)
    assert not file.read(Location(file.slab, 0, -1), key("a"), torch.zeros(4))
    file.close()


def test_a_second_file_takes_the_next_slab_and_reads_the_first(tmp_path):
    first = slab_file(tmp_path)
    second = slab_file(tmp_path)
    assert (first.slab, second.slab) == (0, 1)
    first.write(2, key("a"), 3, torch.full((4,), 7.0), Heat(0.0, 0.0))
    out = torch.zeros(4)
    assert second.read(Location(0, 2, 3), key("a"), out) and out[0] == 7.0
    first.close()
    second.close()


def test_a_reopened_slab_recovers_its_records_and_zeroes_those_past_a_shrink(tmp_path):
    file = slab_file(tmp_path, num_slots=4)
    for slot, (char, generation) in enumerate((("a", 2), ("b", 1), ("c", 3))):
        file.write(slot, key(char), generation, torch.ones(4), Heat(float(slot), 0.0))
    file.close()
    smaller = SlabFile(str(tmp_path), seed=9, block_bytes=16, num_slots=2)
    assert smaller.open() == [
        Recovered(1, 1, key("b"), Heat(1.0, 0.0)),
        Recovered(2, 0, key("a"), Heat(0.0, 0.0)),
    ]
    smaller.allocate()
    assert os.path.getsize(slab_path(str(tmp_path), 0, "idx")) == 2 * RECORD.size
    smaller.close()


def test_a_failed_write_turns_the_file_off_with_one_warning(tmp_path, monkeypatch, caplog):
    file = slab_file(tmp_path)

    def full(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with caplog.at_level(logging.WARNING, logger="replicas.kv.disk"):
        file.write(0, key("a"), 1, torch.ones(4), Heat(0.0, 0.0))
        file.clear_all()
    assert not file.enabled
    assert [r.getMessage() for r in caplog.records if "disk tier off" in r.getMessage()] == [
        f"disk tier off, going on with NPU and host tiers: writing "
        f"{slab_path(str(tmp_path), 0, 'kv')} failed: [Errno 28] No space left on device"
    ]
    file.close()


# ---- the own slot index ----------------------------------------------------------------------
def test_own_slots_fill_from_slot_zero_then_replace_the_least_recently_used():
    slots = OwnSlots(2, max_retained=0, clock=Clock())
    assert slots.take(key("a"), Heat(0.0, 0.0)) == (0, 1, None)
    assert slots.take(key("b"), Heat(0.0, 0.0)) == (1, 2, None)
    slots.touch(key("a"))
    assert slots.take(key("c"), Heat(0.0, 0.0)) == (1, 3, key("b"))
    assert list(slots) == [key("a"), key("c")] and slots.num_evicted == 1
    assert slots.forget(key("a")) == 0 and slots.forget(key("a")) is None
    assert slots.num_free == 1 and slots.usage() == (2, 0, 1, 0)
    assert slots.clear() == [key("c")] and slots.num_free == 2


def test_batch_own_slots_are_replaced_first_until_an_interactive_store_makes_one_ordinary():
    slots = OwnSlots(3, max_retained=0, clock=Clock())
    slots.take(key("a"), Heat(0.0, 0.0))
    slots.take(key("b"), Heat(0.0, 0.0), batch=True)
    slots.take(key("c"), Heat(0.0, 0.0), batch=True)
    slots.touch(key("b"))  # a read keeps its class: b is the most recent batch block
    assert slots.take(key("d"), Heat(0.0, 0.0)).evicted == key("c")  # not a, the oldest
    slots.touch(key("b"), batch=False)  # stored again by an interactive request: ordinary
    assert slots.take(key("e"), Heat(0.0, 0.0)).evicted == key("a")
    assert slots.forget(key("b")) is not None and slots.clear() == [key("d"), key("e")]


def test_retained_own_slots_are_skipped_until_their_deadline():
    clock = Clock(0.0)
    slots = OwnSlots(2, max_retained=1, clock=clock)
    slots.take(key("a"), Heat(0.0, 0.0))
    slots.take(key("b"), Heat(0.0, 0.0))
    assert slots.retain(key("a"), 10.0) and not slots.retain(key("b"), 10.0)  # one at most
    assert not slots.retain(key("z"), 10.0)  # not an own block
    assert slots.take(key("c"), Heat(0.0, 0.0)).evicted == key("b")
    assert slots.retain(key("a"), 20.0) and slots.usage().num_retained == 1  # extended
    clock.now = 15.0
    slots.expire()
    assert slots.num_retained == 1
    clock.now = 20.0
    slots.expire()
    assert slots.num_retained == 0
    assert slots.take(key("d"), Heat(0.0, 0.0)).evicted == key("a")


def test_when_every_own_slot_is_retained_the_least_recently_used_goes():
    slots = OwnSlots(1, max_retained=1, clock=Clock(0.0))
    slots.take(key("a"), Heat(0.0, 0.0))
    slots.retain(key("a"), 10.0)
    assert slots.take(key("b"), Heat(0.0, 0.0)).evicted == key("a")
    assert slots.num_retained == 0


def test_restored_slots_keep_the_newer_copy_of_a_key_and_count_generations_on():
    slots = OwnSlots(4, max_retained=0, clock=Clock())
    slots.restore(
        [
            Recovered(1, 2, key("a"), Heat(1.0, 0.0)),
            Recovered(4, 0, key("b"), Heat(0.0, 0.0)),
            Recovered(6, 3, key("a"), Heat(2.0, 0.0)),
        ]
    )
    assert list(slots) == [key("b"), key("a")] and slots.slot_of(key("a")) == 3
    assert slots.heat_of(key("a")) == Heat(2.0, 0.0) and slots.num_free == 2
    assert slots.take(key("c"), Heat(0.0, 0.0)) == (1, 7, None)  # the lowest free slot


# ---- the peers' slabs ------------------------------------------------------------------------
def write_index(directory, slab: int, records: list[bytes | None]) -> None:
    data = b"".join(record or bytes(RECORD.size) for record in records)
    with open(slab_path(str(directory), slab, "idx"), "wb") as index:
        index.write(data)


def test_peers_learn_other_slabs_first_slab_first_and_skip_their_own(tmp_path):
    write_index(tmp_path, 0, [pack_record(1, key("a"), 0, 16, Heat(3.0, 1.0))])
    write_index(tmp_path, 1, [None, pack_record(2, key("a"), 0, 16, Heat(0.0, 0.0))])
    write_index(tmp_path, 2, [pack_record(5, key("b"), 0, 16, Heat(0.0, 0.0))])
    peers = PeerSlabs(str(tmp_path), own_slab=2)
    assert peers.held_keys() == [key("a")]
    assert peers.locate(key("a")) == Location(0, 0, 1)
    assert peers.heat_of(key("a")) == Heat(3.0, 1.0)
    assert peers.locate(key("b")) is None  # the own slab's
    peers.mark_bad(key("a"))
    assert peers.locate(key("a")) is None and peers.held_keys() == []


def test_peers_see_a_changed_or_removed_index_on_the_next_refresh(tmp_path, monkeypatch):
    clock = Clock(0.0)
    monkeypatch.setattr(peers_module, "time", SimpleNamespace(monotonic=clock))
    write_index(tmp_path, 0, [pack_record(1, key("a"), 0, 16, Heat(0.0, 0.0))])
    peers = PeerSlabs(str(tmp_path), own_slab=1)
    assert peers.held_keys() == [key("a")]
    write_index(tmp_path, 0, [None, pack_record(2, key("b"), 0, 16, Heat(0.0, 0.0))])
    clock.now += PEER_REFRESH_S / 2
    assert peers.locate(key("b")) is None  # looked too recently: not yet
    clock.now += PEER_REFRESH_S / 2
    assert peers.locate(key("b")) == Location(0, 1, 2)
    write_index(tmp_path, 0, [pack_record(3, key("c"), 0, 16, Heat(0.0, 0.0))])
    assert peers.held_keys() == [key("c")]  # a forced look
    os.remove(slab_path(str(tmp_path), 0, "idx"))
    assert peers.held_keys() == []


# ---- the hotness ranking ---------------------------------------------------------------------
def test_the_ranking_orders_own_and_peer_blocks_by_decayed_weight(tmp_path):
    wall = Clock(1000.0)
    write_index(tmp_path, 0, [pack_record(1, key("p"), 0, 16, Heat(4.0, 1000.0))])
    slots = OwnSlots(3, max_retained=0, clock=Clock())
    peers = PeerSlabs(str(tmp_path), own_slab=1)
    peers.held_keys()
    ranking = HeatRanking(slots, peers, wall)
    slots.take(key("a"), Heat(6.0, 1000.0 - HIT_HALF_LIFE_S))  # 3 now
    slots.take(key("b"), Heat(3.0, 1000.0))  # 3 now, weighed later: ahead of a
    assert ranking.weight(key("a")) == pytest.approx(3.0) and ranking.weight(key("z")) == 0.0
    keys = [key("z"), key("a"), key("b"), key("p")]
    assert ranking.hottest(keys) == [key("p"), key("b"), key("a"), key("z")]


def test_room_for_takes_free_slots_then_strictly_colder_ordinary_blocks(tmp_path):
    slots = OwnSlots(3, max_retained=1, clock=Clock(0.0))
    ranking = HeatRanking(slots, PeerSlabs(str(tmp_path), own_slab=0), Clock(0.0))
    slots.take(key("a"), Heat(1.0, 0.0))
    slots.take(key("b"), Heat(0.5, 0.0))
    assert ranking.room_for([5.0, 5.0]) == (2, [key("b")])  # one free slot, then b
    slots.take(key("c"), Heat(0.0, 0.0))
    slots.retain(key("c"), 10.0)  # retained: never replaced
    assert ranking.room_for([1.0, 1.0]) == (1, [key("b")])  # a is not strictly colder
    assert slots.usage().num_cached == 3  # nothing changed


# ---- the change log --------------------------------------------------------------------------
def test_the_change_log_records_only_once_tracked():
    changes = ChangeLog()
    changes.note(True, key("a"))
    assert changes.drain() == [] and not changes.tracking
    changes.track([key("a")])
    changes.track([key("z")])  # tracking already: no-op
    changes.note(False, key("a"))
    assert changes.drain() == [(True, key("a")), (False, key("a"))]
    assert changes.drain() == []


def test_a_decaying_retained_slot_outlives_fresher_ordinary_ones_then_yields_to_them():
    """Decay: used at 0 and retained until 100, ``a`` counts at ``t`` as used at ``100 - t``:
    at 10 (90) it outlives ``b`` used at 5; at 96 (4) it goes before ``c`` used at 5 and 50."""
    clock = Clock(0.0)
    slots = OwnSlots(3, max_retained=1, clock=clock, decay=True)
    slots.take(key("a"), Heat(0.0, 0.0))
    assert slots.retain(key("a"), 100.0)
    clock.now = 5.0
    slots.take(key("b"), Heat(0.0, 0.0))
    slots.take(key("c"), Heat(0.0, 0.0))
    clock.now = 10.0
    assert slots.take(key("d"), Heat(0.0, 0.0)).evicted == key("b")
    clock.now = 50.0
    slots.touch(key("d"))
    clock.now = 96.0
    assert slots.take(key("e"), Heat(0.0, 0.0)).evicted == key("a")
    assert slots.num_retained == 0 and list(slots) == [key("c"), key("d"), key("e")]


def test_a_decayed_slot_is_ordinary_at_its_last_use_after_its_deadline_not_at_the_back():
    """Pin moves a retained slot that eviction meets to the back, so once ordinary it outlives
    blocks used after it (``c``); decay leaves it where its last use put it."""
    for decay, evicted in ((True, "a"), (False, "c")):
        clock = Clock(0.0)
        slots = OwnSlots(4, max_retained=1, clock=clock, decay=decay)
        slots.take(key("a"), Heat(0.0, 0.0))
        slots.retain(key("a"), 20.0)
        clock.now = 1.0
        for name in "bcx":
            slots.take(key(name), Heat(0.0, 0.0))
        clock.now = 2.0
        assert slots.take(key("d"), Heat(0.0, 0.0)).evicted == key("b")
        clock.now = 30.0  # a's retention has ended
        assert slots.take(key("e"), Heat(0.0, 0.0)).evicted == key(evicted)


def test_a_retained_slot_used_again_restarts_its_decay():
    clock = Clock(0.0)
    slots = OwnSlots(2, max_retained=1, clock=clock, decay=True)
    slots.take(key("a"), Heat(0.0, 0.0))
    slots.retain(key("a"), 100.0)
    clock.now = 60.0
    slots.take(key("b"), Heat(0.0, 0.0))
    clock.now = 70.0
    slots.touch(key("a"))  # now counts as used at 70 + 100 - t
    clock.now = 99.0
    assert slots.take(key("c"), Heat(0.0, 0.0)).evicted == key("b")


def test_a_tenant_over_its_quota_of_own_slots_is_replaced_first():
    """Tenant 3 holds 2 of 4 slots against a quota of 1: its least recently used block goes
    before the slab's least recently used one (tenant 2's); within quota again, one LRU. A
    retained block of a tenant over its quota is skipped as in the LRU."""
    slots = OwnSlots(4, max_retained=1, clock=Clock(0.0))
    for name, tenant in zip("abcd", (2, 3, 3, 2)):
        slots.take(key(name), Heat(0.0, 0.0), tenant=tenant)
    slots.tenants.set_shares({3: 0.25})
    assert list(slots.tenants.quotas.over) == [3]
    slots.retain(key("b"), until=10.0)
    assert slots.take(key("e"), Heat(0.0, 0.0), tenant=2).evicted == key("c")  # not a, nor b
    assert slots.tenants.quotas.held == {2: 3, 3: 1} and not slots.tenants.quotas.over
    assert slots.take(key("f"), Heat(0.0, 0.0)).evicted == key("a")  # one LRU again
    slots.forget(key("b"))
    assert slots.tenants.quotas.held == {2: 2, 3: 0}
    slots.clear()
    assert slots.tenants.quotas.held == {2: 0, 3: 0}
