"""Prompt prefixes every tenant may share (``PrefixCacheConfig.shared_prefixes``).

Each ``cache_salt`` is a tenant: its blocks hash apart from every other tenant's
(``replicas.kv.hashing``). A configured shared prefix (a system prompt, a tool catalogue) is
the exception: in a prompt that starts with it, the full blocks inside it hash without the salt,
so every tenant, and requests with no salt, reuse the same blocks in every tier; the salt joins
the chain at the first block past them, so everything after the shared prefix stays the
tenant's own::

    prompt   [ shared prefix ........ | tenant's own .......... ]
    blocks   [ b0 ][ b1 ][ b2 ][ b3 ]X[ b4 ][ b5 ] ...
    hashes    unsalted (shared)        salted from here on (b3 holds the prefix's last tokens
                                       and its suffix's first ones: it is the tenant's)

Only the prefix's full blocks are shared. A prompt matching several prefixes shares the longest.
Text prefixes are matched on token ids: the text as it appears in the rendered prompt (for a
chat, inside the chat template), tokenized with and without the model's BOS.
"""

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from replicas.kv.hashing import BlockHash, block_hashes

if TYPE_CHECKING:
    from replicas.model.tokenizer import Tokenizer


class SharedPrefixes:
    """The configured shared prefixes, as token ids."""

    __slots__ = ("_prefixes",)

    def __init__(self, prefixes: Iterable[Sequence[int]] = ()) -> None:
        unique = {tuple(p) for p in prefixes if p}
        self._prefixes = sorted(unique, key=len, reverse=True)  # longest first

    @classmethod
    def from_config(
        cls, prefixes: Sequence["str | list[int]"], tokenizer: "Tokenizer"
    ) -> "SharedPrefixes":
        """Text prefixes tokenized both with and without BOS; token-id prefixes as given."""
        ids: list[Sequence[int]] = []
        for prefix in prefixes:
            if isinstance(prefix, str):
                ids.append(tokenizer.encode(prefix, add_special_tokens=True))
                ids.append(tokenizer.encode(prefix, add_special_tokens=False))
            else:
                ids.append(prefix)
        return cls(ids)

    def __bool__(self) -> bool:
        return bool(self._prefixes)

    def __reduce__(self):
        return (SharedPrefixes, (self._prefixes,))

    def num_blocks(self, token_ids: Sequence[int], block_size: int) -> int:
        """Full blocks of ``token_ids`` inside the longest shared prefix it starts with."""
        for prefix in self._prefixes:
            n = len(prefix)
            if len(token_ids) >= n and tuple(token_ids[:n]) == prefix:
                return n // block_size
        return 0

    def hashes(
        self, token_ids: Sequence[int], block_size: int, salt: str | None
    ) -> list[BlockHash]:
        """The block hashes of ``token_ids`` as a replica computes them for this salt."""
        shared = self.num_blocks(token_ids, block_size) if salt is not None else 0
        return block_hashes(token_ids, block_size, salt, shared)


NO_SHARED_PREFIXES = SharedPrefixes()
