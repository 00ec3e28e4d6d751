from replicas.kv.hashing import DIGEST_SIZE, block_hashes, extend_block_hashes, hash_block


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(list(range(47)), 16)) == 2
    assert len(block_hashes(list(range(48)), 16)) == 3
    assert block_hashes([1, 2, 3], 16) == []


def test_hash_chains_the_prefix():
    a = block_hashes([1] * 16 + [2] * 16, 16)
    b = block_hashes([9] * 16 + [2] * 16, 16)
    assert a[1] != b[1]  # same block tokens, different parent
    assert a[0] == hash_block(None, [1] * 16)
    assert a[1] == hash_block(a[0], [2] * 16)
    assert all(len(h) == DIGEST_SIZE for h in a)


def test_shared_prefix_shares_hashes_exactly():
    base = list(range(100))
    a = block_hashes(base + [1, 2, 3], 16)
    b = block_hashes(base[:70] + [7] * 33, 16)
    assert a[:4] == b[:4]
    assert a[4] != b[4]


def test_salt_isolates_tenants():
    tokens = list(range(64))
    plain = block_hashes(tokens, 16)
    alice = block_hashes(tokens, 16, salt="alice")
    bob = block_hashes(tokens, 16, salt="bob")
    assert not set(plain) & set(alice)
    assert not set(alice) & set(bob)
    assert alice == block_hashes(tokens, 16, salt="alice")


def test_token_packing_is_unambiguous():
    # Large ids must not alias small ones when packed.
    assert hash_block(None, [1, 0]) != hash_block(None, [256])
    assert hash_block(None, [2**40]) != hash_block(None, [0])


def test_extend_matches_full_hashing():
    tokens = list(range(80))
    hashes = block_hashes(tokens[:37], 16)
    extend_block_hashes(hashes, tokens, 16)
    assert hashes == block_hashes(tokens, 16)
