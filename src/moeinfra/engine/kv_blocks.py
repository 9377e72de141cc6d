"""Paged KV-cache bookkeeping: which cache blocks each sequence owns, and prefix sharing by hash.

The cache is ``num_blocks`` blocks of ``block_size`` token slots; block ``b`` holds slots
``b * block_size .. b * block_size + block_size - 1``. This module hands out block ids only; what a
slot stores (here, one token's compressed MLA latent) is the model runner's business.

A full block whose KV has been computed is registered under a chained digest of its tokens and its
parent block's digest (:func:`block_hashes`), so a later prompt with the same prefix reuses it. Every
block is in exactly one state:

* free — no reference, no hash; reused first;
* evictable — no reference but a registered hash; still a prefix-cache hit until its id is needed
  for a new block, least recently released first;
* in use — referenced by the block table of one or more sequences.

Sequences write only into their own last, unshared blocks (hits end a whole block before the last
prompt token), so blocks are never copied.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from moeinfra.errors import InputError

_DIGEST_BYTES = 32
_PERSON = b"moeinfra-kv"


def _chain_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Digest (32 bytes) of one block's token ids under its parent block's digest."""
    h = hashlib.blake2b(parent, digest_size=_DIGEST_BYTES, person=_PERSON)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Digest of each full block of ``token_ids``, stable across processes and runs.

    Block ``i``'s digest is BLAKE2b-256 (personalisation ``b"moeinfra-kv"``) of block ``i - 1``'s
    digest (nothing for block 0) followed by the block's token ids as little-endian int64, so equal
    digests mean equal whole prefixes. Returns ``len(token_ids) // block_size`` digests; a trailing
    partial block has none.
    """
    if block_size < 1:
        raise InputError(f"block_size={block_size!r}: must be a positive number of tokens")
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _chain_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class _Seq:
    """One sequence's block table; ``last_hash`` is the digest of its block ``num_hashed - 1``.

    Its first ``num_hashed`` blocks are full and computed (registered in the prefix cache unless
    another block held the same digest first).
    """

    blocks: list[int] = field(default_factory=list)
    num_hashed: int = 0
    last_hash: bytes = b""


class BlockManager:
    """Block tables, reference counts and the prefix cache of ``num_blocks`` blocks of
    ``block_size`` tokens.

    Typical use by an engine: :meth:`allocate_prefix` when a request arrives (cached tokens need no
    prefill), :meth:`blocks_needed`/:meth:`can_allocate` to decide admission, :meth:`ensure_slots`
    before each step, :meth:`slot_mapping` to place the step's tokens, :meth:`mark_computed` after
    it, :meth:`free` when the request finishes or is aborted.

    ``reuse_last_block=False`` leaves the last matching block of a prefix to be recomputed: with an
    MTP draft layer, a block's last cache entry depends on the token after the block (vLLM drops
    that block for EAGLE drafts too). ``prefix_blocks``: a cached prefix is taken in multiples of
    this many blocks (a model that resumes only at such positions: DeepSeek-V4's checkpoints).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 64,
        reuse_last_block: bool = True,
        prefix_blocks: int = 1,
    ) -> None:
        if num_blocks < 1:
            raise InputError(f"num_blocks={num_blocks!r}: must be a positive number of blocks")
        if block_size < 1:
            raise InputError(f"block_size={block_size!r}: must be a positive number of tokens")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.reuse_last_block = reuse_last_block
        self.prefix_blocks = prefix_blocks
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        # block id -> None, least recently released first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._seqs: dict[int, _Seq] = {}
        self.queried_tokens = 0
        """Prompt tokens passed to :meth:`allocate_prefix` so far."""
        self.hit_tokens = 0
        """Of those, tokens found in the prefix cache (what :meth:`allocate_prefix` returned)."""
        self.on_free: list = []
        """Called with the sequence id whenever :meth:`free` releases a sequence."""

    # ------------------------------------------------------------------ statistics

    @property
    def num_free_blocks(self) -> int:
        """Blocks available for new allocations: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a registered hash (in use or evictable)."""
        return len(self._cached)

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / queried_tokens`` (0 before any query)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    # ------------------------------------------------------------------ sequences

    def allocate_prefix(self, seq_id: int, token_ids: Sequence[int], use_cache: bool = True) -> int:
        """Register sequence ``seq_id`` with prompt ``token_ids`` and take its cached prefix.

        References the longest run of computed full blocks matching the prompt's start, capped so
        at least one prompt token is left to compute. Allocates no new block. Returns the number of
        cached tokens: a multiple of ``block_size``, less than ``len(token_ids)``. With
        ``use_cache=False`` the sequence takes nothing from the cache (and counts no query).
        """
        if seq_id in self._seqs:
            raise InputError(f"seq_id={seq_id!r}: already allocated; free it first or use a new id")
        if len(token_ids) == 0:
            raise InputError("token_ids=[]: a prompt must hold at least one token")
        seq = _Seq()
        if not use_cache:
            self._seqs[seq_id] = seq
            return 0
        for digest, block in self._cached_prefix(token_ids):
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
            seq.blocks.append(block)
            seq.last_hash = digest
        seq.num_hashed = len(seq.blocks)
        self._seqs[seq_id] = seq
        cached = len(seq.blocks) * self.block_size
        self.queried_tokens += len(token_ids)
        self.hit_tokens += cached
        return cached

    def _cached_prefix(self, token_ids: Sequence[int]) -> list[tuple[bytes, int]]:
        """``(digest, block)`` of the computed full blocks matching the prompt's start, leaving at
        least one prompt token uncovered."""
        found: list[tuple[bytes, int]] = []
        parent = b""
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            parent = _chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block = self._cached.get(parent)
            if block is None:
                break
            found.append((parent, block))
        found = found if self.reuse_last_block else found[:-1]
        return found[: len(found) // self.prefix_blocks * self.prefix_blocks]

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens :meth:`allocate_prefix` would find cached now (changes nothing)."""
        return len(self._cached_prefix(token_ids)) * self.block_size

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """New blocks sequence ``seq_id`` needs to hold ``num_tokens`` tokens in total."""
        seq = self._get(seq_id)
        if num_tokens < 0:
            raise InputError(f"num_tokens={num_tokens!r}: must be >= 0")
        return max(0, -(-num_tokens // self.block_size) - len(seq.blocks))

    def can_allocate(self, num_new_blocks: int) -> bool:
        """Whether ``num_new_blocks`` blocks can be allocated now (evicting cached ones if needed)."""
        return num_new_blocks <= self.num_free_blocks

    def ensure_slots(self, seq_id: int, num_tokens: int) -> bool:
        """Grow sequence ``seq_id``'s block table to hold ``num_tokens`` tokens in total.

        All or nothing: returns False and changes nothing when too few blocks are free or
        evictable. Never shrinks the table.
        """
        needed = self.blocks_needed(seq_id, num_tokens)
        if not self.can_allocate(needed):
            return False
        self._seqs[seq_id].blocks.extend(self._take_block() for _ in range(needed))
        return True

    def mark_computed(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """Record that the first ``num_computed`` tokens of sequence ``seq_id`` have KV in the cache.

        ``token_ids`` is the sequence's whole token list so far. Each full block among the computed
        tokens is registered in the prefix cache, unless another block already holds its hash (that
        entry is kept; this sequence keeps its own block).
        """
        seq = self._get(seq_id)
        capacity = len(seq.blocks) * self.block_size
        if not 0 <= num_computed <= min(len(token_ids), capacity):
            raise InputError(
                f"num_computed={num_computed!r}: must be in [0, {min(len(token_ids), capacity)}] "
                f"(len(token_ids)={len(token_ids)}, slots allocated={capacity})"
            )
        bs = self.block_size
        for i in range(seq.num_hashed, num_computed // bs):
            seq.last_hash = _chain_hash(seq.last_hash, token_ids[i * bs : (i + 1) * bs])
            seq.num_hashed = i + 1
            if seq.last_hash not in self._cached:
                block = seq.blocks[i]
                self._cached[seq.last_hash] = block
                self._hash[block] = seq.last_hash

    def free(self, seq_id: int) -> None:
        """Release sequence ``seq_id`` (finished or aborted) and drop its block references.

        Blocks left unreferenced become evictable if hashed, else free. They are released last
        block first, so a prefix's deeper blocks are evicted before the blocks it starts with
        (which more prompts share, and whose loss would strand the deeper ones anyway).
        """
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        for block in reversed(seq.blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._hash[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None
        for listener in self.on_free:
            listener(seq_id)

    def block_table(self, seq_id: int) -> list[int]:
        """Block ids of sequence ``seq_id``, in token order (a copy)."""
        return list(self._get(seq_id).blocks)

    def slot_mapping(self, seq_id: int, start: int, end: int) -> np.ndarray:
        """Cache slot of each token position ``start .. end - 1`` of sequence ``seq_id``.

        Returns int64 ``[end - start]``. The positions must lie within the allocated blocks.
        """
        blocks = self._get(seq_id).blocks
        capacity = len(blocks) * self.block_size
        if not 0 <= start <= end <= capacity:
            raise InputError(
                f"(start, end)=({start!r}, {end!r}): must satisfy 0 <= start <= end <= {capacity} "
                f"(slots allocated to seq_id={seq_id!r})"
            )
        bs = self.block_size
        first = start // bs
        table = np.asarray(blocks[first : -(-end // bs)], dtype=np.int64)
        pos = np.arange(start, end, dtype=np.int64)
        return table[pos // bs - first] * bs + pos % bs

    # ------------------------------------------------------------------ cache maintenance

    def reset_prefix_cache(self) -> int:
        """Forget the hash of every evictable block, making it free; returns how many.

        Blocks in use keep their hashes.
        """
        dropped = len(self._evictable)
        for block in self._evictable:
            del self._cached[self._hash[block]]
            self._hash[block] = None
            self._free.append(block)
        self._evictable.clear()
        return dropped

    def check(self) -> None:
        """Verify the invariants; raise RuntimeError naming the first one broken.

        Every block is exactly one of free / evictable / in use, reference counts equal the number
        of block tables holding the block, and the hash map and per-block hashes agree.
        """
        refs = [0] * self.num_blocks
        for seq_id, seq in self._seqs.items():
            if len(set(seq.blocks)) != len(seq.blocks):
                raise RuntimeError(f"seq {seq_id}: block table {seq.blocks} repeats a block")
            if seq.num_hashed > len(seq.blocks):
                raise RuntimeError(
                    f"seq {seq_id}: {seq.num_hashed} blocks hashed but only {len(seq.blocks)} held"
                )
            for block in seq.blocks:
                refs[block] += 1
        if refs != self._ref:
            bad = next(b for b in range(self.num_blocks) if refs[b] != self._ref[b])
            raise RuntimeError(
                f"block {bad}: refcount {self._ref[bad]} but held by {refs[bad]} block tables"
            )
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("free list holds a block twice")
        for block in range(self.num_blocks):
            states = [
                name
                for name, member in (
                    ("free", block in free),
                    ("evictable", block in self._evictable),
                    ("in use", refs[block] > 0),
                )
                if member
            ]
            if len(states) != 1:
                raise RuntimeError(
                    f"block {block}: in states {states or 'none'}, expected exactly one"
                )
            hashed = self._hash[block] is not None
            if (states[0] == "free" and hashed) or (states[0] == "evictable" and not hashed):
                raise RuntimeError(
                    f"block {block}: {states[0]} but its hash is {self._hash[block]!r}; free blocks "
                    "have none and evictable blocks have one"
                )
            digest = self._hash[block]
            if digest is not None and self._cached.get(digest) != block:
                raise RuntimeError(
                    f"block {block}: its hash maps to block {self._cached.get(digest)}"
                )
        for digest, block in self._cached.items():
            if self._hash[block] != digest:
                raise RuntimeError(
                    f"hash map sends {digest.hex()[:16]}... to block {block}, whose hash differs"
                )

    # ------------------------------------------------------------------ internals

    def _get(self, seq_id: int) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise InputError(f"seq_id={seq_id!r}: unknown; allocate_prefix it first")
        return seq

    def _take_block(self) -> int:
        """A block id for new tokens, evicting the least recently released cached block if no
        free block is left."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash[block]]
            self._hash[block] = None
        self._ref[block] = 1
        return block
