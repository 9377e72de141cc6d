"""The on-disk prefix KV cache (DeepSeek's lives on 3FS): content-hashed blocks in a directory.

A block is the KV of ``block_size`` prompt tokens, named by the chained BLAKE2b digest of the
prompt up to and including it (:func:`~moeinfra.engine.kv_blocks.block_hashes`), so equal names
mean equal prefixes. Blocks sit under a namespace per model fingerprint (config, weights, dtype,
block size, layout), so two checkpoints never share one. Every prefill unit on the host (or on a
shared file system: NFS, 3FS) reads and writes the same directory; it survives restarts.

A file is ``MAGIC | crc32 | payload``, written to a temporary name unique across hosts and
renamed into place, so a reader sees a whole block or none; a block whose size or checksum is
wrong (a torn copy, a disk error) is deleted and counted as a miss. A read or write stamps the
prompt's blocks' mtimes, the first block newest (a prefix's head is shared by more prompts than
its tail, and a tail is useless without its head).

One byte cap holds for every writer: the namespace's bytes are counted in a ledger file
(``.bytes``) that each writer updates under an exclusive ``flock`` (NFSv4 and local file systems
lock it across hosts). The writer whose blocks pass the cap evicts, still holding the lock, the
least recently used blocks down to 90% of it: one directory listing (names only) per tenth of the
cap written, whoever wrote it. Every block of a namespace has one size, so the ledger counts
blocks without a ``stat``; eviction reads the times of a random sample of
:data:`EVICT_SAMPLE` files per block it must delete (at least :data:`EVICT_SAMPLE_MIN`: a small
cache is exact LRU) and deletes the oldest of them, an approximate LRU as Redis's
``maxmemory-samples`` (a ``stat`` is a round trip on NFS or 3FS, and a large cache holds millions
of blocks).

A unit that drafts with the MTP layer caches one more layer (a namespace of its own), whose entry
at a block's last position depends on the token after the block. So, as the engine's in-memory
prefix cache does with MTP (``reuse_last_block=False``), the last block of a hit is not used (it
is recomputed, with the token that follows it in this prompt), and a prompt stores only the blocks
a prompt token follows (not a last block whose next token was generated).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import random
import secrets
import socket
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moeinfra.engine.kv_blocks import block_hashes
from moeinfra.engine.sequence import Preloaded
from moeinfra.errors import InputError

MAGIC = b"MOEKV001"
#: files whose times an eviction reads per block it deletes, and at least
EVICT_SAMPLE, EVICT_SAMPLE_MIN = 4, 1024
_HEADER = struct.Struct("<8sI")


#: Bytes sampled from each weight file for :func:`weights_digest`: 16 evenly spaced windows.
WEIGHT_SAMPLES, SAMPLE_BYTES = 16, 64 << 10
LEDGER = ".bytes"


def weights_digest(model_dir: str | Path) -> str:
    """Digest of a checkpoint's weights: each ``*.safetensors`` file's name, size and 16
    windows of 64 KiB spread over it (its header among them). Reading a few MiB instead of
    hundreds of GB still tells a fine-tune from its base (training changes every tensor), so
    two checkpoints with the same ``config.json`` do not share KV."""
    h = hashlib.blake2b(digest_size=12)
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}|{size}|".encode())
        with open(path, "rb") as f:
            for k in range(WEIGHT_SAMPLES):
                f.seek(max(0, size - SAMPLE_BYTES) * k // (WEIGHT_SAMPLES - 1))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def model_fingerprint(model_dir: str | Path, dtype: torch.dtype, block_size: int, shape) -> str:
    """Hex digest naming the cache namespace of a checkpoint (its ``config.json`` and
    :func:`weights_digest`), cache dtype, block size and layout ``shape``."""
    h = hashlib.blake2b((Path(model_dir) / "config.json").read_bytes(), digest_size=12)
    h.update(f"{weights_digest(model_dir)}|{dtype}|{block_size}|{tuple(shape)}".encode())
    return h.hexdigest()


@dataclass
class DiskStats:
    """Counters of one process's use of the cache (tokens and blocks)."""

    hit_tokens: int = 0
    queried_tokens: int = 0
    written_blocks: int = 0
    corrupt_blocks: int = 0
    evicted_blocks: int = 0


class DiskKVCache:
    """Prefix KV blocks of one model in ``root/<fingerprint>/``, at most ``capacity_bytes`` in all.

    ``layers``, ``values``: the cache layout (a block is ``[layers, block_size, values]`` of
    ``dtype``). ``reuse_last_block=False`` (a unit drafting with MTP): a lookup leaves out the last
    block of its hit and a prompt stores only the blocks a prompt token follows (module docstring).
    """

    def __init__(
        self,
        root: str | Path,
        fingerprint: str,
        block_size: int,
        layers: int,
        values: int,
        dtype: torch.dtype,
        capacity_bytes: int,
        reuse_last_block: bool = True,
    ) -> None:
        if capacity_bytes < 1:
            raise InputError(f"capacity_bytes={capacity_bytes} must be >= 1")
        self.dir = Path(root) / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.block_size, self.layers, self.values, self.dtype = block_size, layers, values, dtype
        self.capacity_bytes = capacity_bytes
        self.reuse_last_block = reuse_last_block
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.payload_bytes = layers * block_size * values * itemsize
        self.file_bytes = _HEADER.size + self.payload_bytes
        self.stats = DiskStats()
        self._remove_stale_temporaries()

    def _remove_stale_temporaries(self, age_s: float = 60.0) -> None:
        """Delete temporary files a crashed writer left (older than ``age_s``; a live writer's
        temporary lives milliseconds)."""
        import time

        for tmp in self.dir.glob("*/.*.tmp"):
            with contextlib.suppress(OSError):
                if time.time() - tmp.stat().st_mtime > age_s:
                    tmp.unlink()

    def _path(self, digest: bytes) -> Path:
        name = digest.hex()
        return self.dir / name[:2] / f"{name}.kv"

    def _block_names(self) -> list[str]:
        """Every block file's path (names only: no ``stat``)."""
        names = []
        with contextlib.suppress(OSError), os.scandir(self.dir) as top:
            for sub in top:
                if len(sub.name) == 2 and sub.is_dir(follow_symlinks=False):
                    with contextlib.suppress(OSError), os.scandir(sub.path) as inner:
                        names += [e.path for e in inner if e.name.endswith(".kv")]
        return names

    def cached_tokens(self, token_ids: list[int]) -> int:
        """Prompt tokens a lookup would find (files present; contents not read)."""
        n = 0
        for digest in block_hashes(token_ids[: len(token_ids) - 1], self.block_size):
            if not self._path(digest).exists():
                break
            n += self.block_size
        return n if self.reuse_last_block else max(0, n - self.block_size)

    def lookup(self, token_ids: list[int], skip_tokens: int = 0) -> Preloaded | None:
        """KV of the longest run of cached blocks starting the prompt (leaving >= 1 token to
        compute), from token ``skip_tokens`` (a multiple of the block size already held
        elsewhere) on; None when the disk adds nothing."""
        digests = block_hashes(token_ids[: len(token_ids) - 1], self.block_size)
        first = skip_tokens // self.block_size
        blocks = []
        for i, digest in enumerate(digests[first:], first):
            # without the last block of a hit: a block is used only when the next one is there too
            if not self.reuse_last_block and (
                i + 1 == len(digests) or not self._path(digests[i + 1]).exists()
            ):
                break
            block = self._read(digest)
            if block is None:
                break
            blocks.append(block)
        # (the block after the run too: the run is usable only while it is there)
        follower = 0 if self.reuse_last_block or not blocks else 1
        self._stamp(digests[first : first + len(blocks) + follower])
        self.stats.queried_tokens += len(token_ids)
        if not blocks:
            return None
        self.stats.hit_tokens += len(blocks) * self.block_size
        kv = torch.cat(blocks, dim=1)
        return Preloaded(first * self.block_size, kv)

    def _read(self, digest: bytes) -> torch.Tensor | None:
        path = self._path(digest)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        magic, crc = _HEADER.unpack_from(data) if len(data) >= _HEADER.size else (b"", 0)
        payload = memoryview(data)[_HEADER.size :]
        if len(data) != self.file_bytes or magic != MAGIC or zlib.crc32(payload) != crc:
            self.stats.corrupt_blocks += 1
            path.unlink(missing_ok=True)
            return None
        array = np.frombuffer(payload, dtype=np.uint8).copy()
        flat = torch.from_numpy(array).view(self.dtype)
        return flat.view(self.layers, self.block_size, self.values)

    def store(self, token_ids: list[int], kv: torch.Tensor) -> int:
        """Write every full block of the prompt ``token_ids`` (KV ``[layers, >= tokens, values]``)
        that is not on disk yet (with ``reuse_last_block=False``, every full block a prompt token
        follows); returns how many blocks were written."""
        written = 0
        if not self.reuse_last_block:
            token_ids = token_ids[: len(token_ids) - 1]
        digests = block_hashes(token_ids, self.block_size)
        for i, digest in enumerate(digests):
            path = self._path(digest)
            if path.exists():
                continue
            block = kv[:, i * self.block_size : (i + 1) * self.block_size].contiguous()
            payload = block.view(torch.uint8).numpy().tobytes()
            path.parent.mkdir(exist_ok=True)
            # (host and a random part: writers on several hosts share the directory)
            tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{secrets.token_hex(4)}.tmp")
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(MAGIC, zlib.crc32(payload)))
                f.write(payload)
            os.replace(tmp, path)
            written += 1
        self._stamp(digests)
        self.stats.written_blocks += written
        if written:
            with self._ledger() as total:
                total[0] += written * self.file_bytes
                if total[0] > self.capacity_bytes:
                    total[0] = self._evict()
        return written

    @contextlib.contextmanager
    def _ledger(self) -> Iterator[list[int]]:
        """The namespace's byte count (every writer's), as a one-item list to update, held
        under an exclusive lock until the block ends (a missing or damaged ledger: recounted)."""
        with open(self.dir / LEDGER, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            text = f.read().strip()
            total = [int(text) if text.isdigit() else len(self._block_names()) * self.file_bytes]
            yield total
            f.seek(0)
            f.truncate()
            f.write(str(total[0]))
            f.flush()

    def _stamp(self, digests: list[bytes]) -> None:
        # An explicit nanosecond clock: the kernel's mtime is coarse (a few ms), and ties would
        # be broken by directory order, which differs from one file system to the next.
        now = time.time_ns()
        for i, digest in enumerate(digests):
            with contextlib.suppress(OSError):
                os.utime(self._path(digest), ns=(now - i, now - i))

    def evict(self) -> int:
        """Delete least recently used blocks until the directory is under 90% of its cap (the
        whole directory: other processes' blocks count too); returns blocks deleted."""
        before = self.stats.evicted_blocks
        with self._ledger() as total:
            total[0] = self._evict()
        return self.stats.evicted_blocks - before

    def _evict(self) -> int:
        """:meth:`evict` with the ledger held; returns the bytes left (recounted from the
        listing: what other writers or a lost ledger left is counted again)."""
        names = self._block_names()
        total = len(names) * self.file_bytes
        excess = -(-(total - int(self.capacity_bytes * 0.9)) // self.file_bytes)
        if excess <= 0:
            return total
        sample = max(EVICT_SAMPLE * excess, EVICT_SAMPLE_MIN)
        if sample < len(names):
            names = random.sample(names, sample)
        stamped = []
        for name in names:
            with contextlib.suppress(OSError):
                stamped.append((os.stat(name).st_mtime_ns, name))
        deleted = 0
        for _, name in sorted(stamped)[:excess]:
            with contextlib.suppress(OSError):
                os.unlink(name)
                deleted += 1
        self.stats.evicted_blocks += deleted
        return total - deleted * self.file_bytes

    @property
    def size_bytes(self) -> int:
        """Bytes of blocks in the directory now."""
        return sum(p.stat().st_size for p in self.dir.glob("*/*.kv"))
