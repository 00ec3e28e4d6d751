"""Chained, collision-resistant block hashes: the one thing replicas and the router must agree on.

A block's hash covers its parent's hash, its token ids and the request's cache salt::

    h[0] = blake2b(salt_tag | tokens[0:B])
    h[i] = blake2b(h[i-1]   | tokens[i*B:(i+1)*B])

so two requests share ``h[i]`` only if they share the first ``(i+1) * B`` tokens *and* the salt.
The salt enters only the first block; the chain carries it to every later one. Only full blocks
are hashed. The first ``S`` blocks of a shared prefix (``replicas.kv.shared_prefixes``) hash
without the salt, which joins the chain at block ``S``::

    h[S] = blake2b(join(h[S-1], salt) | tokens[S*B:(S+1)*B]),  join = blake2b(tag | h | salt_tag)
 Python's ``hash()`` is never used: a collision would hand one tenant's KV to another.
"""

from array import array
from collections.abc import Sequence
from hashlib import blake2b

BlockHash = bytes
"""A 16-byte digest identifying a block of tokens and everything before it."""

DIGEST_SIZE = 16
_ROOT_TAG = b"strata-block-v1"
_JOIN_TAG = b"strata-salt-join-v1"


def root_key(salt: str | None) -> bytes:
    """What stands for the parent of a first block: a tag of the salt (never 16 bytes long, so
    never a block hash)."""
    if salt is None:
        return _ROOT_TAG
    # Length-prefixed so that no salt is a prefix-extension of another.
    encoded = salt.encode("utf-8")
    return _ROOT_TAG + len(encoded).to_bytes(4, "little") + encoded


def join_salt(parent: BlockHash, salt: str) -> BlockHash:
    """What stands for the parent of the first salted block after ``parent``, an unsalted
    (shared) one: a hash of its own kind (tagged), so never another block's hash."""
    return blake2b(_JOIN_TAG + parent + root_key(salt), digest_size=DIGEST_SIZE).digest()


def hash_block(
    parent: BlockHash | None, token_ids: "list[int] | tuple[int, ...]", salt: str | None = None
) -> BlockHash:
    """Hash of one full block given its parent's hash (``None`` for the first block)."""
    prefix = parent if parent is not None else root_key(salt)
    packed = array("q", token_ids)
    if packed.itemsize != 8:  # pragma: no cover - every supported platform has 8-byte 'q'
        raise RuntimeError("array('q') must be 8 bytes wide")
    return blake2b(prefix + packed.tobytes(), digest_size=DIGEST_SIZE).digest()


def block_hashes(
    token_ids: "Sequence[int]", block_size: int, salt: str | None = None, shared_blocks: int = 0
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``, in order (a trailing partial block is not
    hashed); the first ``shared_blocks`` without the salt."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return extend_block_hashes([], token_ids, block_size, salt, shared_blocks)


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: "Sequence[int]",
    block_size: int,
    salt: str | None = None,
    shared_blocks: int = 0,
) -> list[BlockHash]:
    """Append to ``hashes`` the hashes of the full blocks of ``token_ids`` not yet hashed.

    ``hashes`` must hold the hashes of the first ``len(hashes)`` blocks of ``token_ids``, with
    the same ``salt`` and ``shared_blocks``. Mutates and returns ``hashes``.
    """
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = parent_key(hashes, i, salt, shared_blocks)
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


def parent_key(
    hashes: "Sequence[BlockHash]", index: int, salt: str | None, shared_blocks: int = 0
) -> bytes:
    """What names the tokens before block ``index`` (its parent in the chain): the salt's root
    key before the first block (none inside a shared prefix), the hash of the block before it,
    or that hash joined with the salt at the end of a shared prefix."""
    if index == 0:
        return root_key(None if shared_blocks else salt)
    parent = hashes[index - 1]
    if index == shared_blocks and salt is not None:
        return join_salt(parent, salt)
    return parent
