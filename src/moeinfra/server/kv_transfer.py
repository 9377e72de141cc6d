"""KV hand-off from a prefill rank to a decode rank over ZeroMQ.

Why ZeroMQ: the transfer must run while the prefill rank computes its next batch. The rank's
sender thread frames a hand-off and check-sums its blocks, a ZeroMQ ``PUSH`` socket queues the
message and its I/O thread sends it in the background (``copy=False`` hands the tensor's memory
over without a copy), so the prefill loop never waits on the framing or the network; multipart
messages keep the blocks as separate frames; and it is the same TCP transport across hosts as on
one. torch.distributed point-to-point would need every prefill and decode rank in one process group
(fixed at start, so units could not come and go) and blocks the caller unless used with ``isend``
and a matching ``irecv`` posted in advance.

A message is ``[header, block 0, block 1, ...]``: the header (a
:class:`~moeinfra.server.messages.KVHeader` in MessagePack, never pickle) names the request, its
prompt and first tokens, sampling parameters, the MTP layer's first drafts (a drafting unit's;
the decode rank verifies them in its first step), the tensor layout, and the CRC-32 of every block;
each block frame is ``[layers, <= block_size tokens, values]`` of the cache dtype (a drafting unit's
``layers`` include the MTP layer's). The receiver
checks the block count, every frame's size and checksum before the request may start decoding.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from moeinfra.engine.handoff import Handoff
from moeinfra.engine.sampling import SamplingParams
from moeinfra.engine.sequence import Preloaded
from moeinfra.server.messages import KVHeader, decode_kv_header, encode


class TransferError(ValueError):
    """A hand-off message that failed verification (what was wrong, which request)."""

    def __init__(self, request_id: str, problem: str) -> None:
        super().__init__(f"request {request_id}: {problem}")
        self.request_id = request_id


@dataclass
class Arrival:
    """A verified hand-off: what :meth:`~moeinfra.engine.core.EngineCore.add_request` needs
    (``drafts``: the prefill unit's first drafts, empty without speculative decoding)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    preloaded: Preloaded
    num_cached_tokens: int
    nbytes: int
    drafts: list[int] = field(default_factory=list)


def blocks_of(kv: torch.Tensor, block_size: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """``kv [layers, tokens, values]`` as blocks ``[layers, <= block_size tokens, bytes]`` back to
    back in one buffer (one copy): ``(buffer, blocks)``, each block a contiguous view of it."""
    kv = kv.contiguous()
    layers, tokens, _ = kv.shape
    raw = kv.view(torch.uint8).numpy().reshape(layers, tokens, -1)
    buffer = np.empty(raw.size, dtype=np.uint8)
    blocks, at = [], 0
    for start in range(0, tokens, block_size):
        part = raw[:, start : start + block_size]
        block = buffer[at : at + part.size].reshape(part.shape)
        block[...] = part
        blocks.append(block)
        at += part.size
    return buffer, blocks


def header_of(
    handoff: Handoff, blocks: list[np.ndarray], block_size: int, source: str = "", address: int = 0
) -> KVHeader:
    """The header of ``handoff`` sent as ``blocks`` (``source``/``address``: where the decode rank
    reads them, see :class:`KVHeader`)."""
    return KVHeader(
        request_id=handoff.request_id,
        prompt_ids=handoff.prompt_ids,
        output_ids=handoff.output_ids,
        params=handoff.params,
        num_cached_tokens=handoff.num_cached_tokens,
        drafts=[int(t) for t in handoff.drafts],
        shape=tuple(handoff.kv.shape),
        dtype=str(handoff.kv.dtype),
        block_size=block_size,
        crc32=[zlib.crc32(b) for b in blocks],
        source=source,
        address=address,
    )


def pack(handoff: Handoff, block_size: int) -> list:
    """Frames of one hand-off whose blocks travel with it."""
    _, blocks = blocks_of(handoff.kv, block_size)
    return [encode(header_of(handoff, blocks, block_size)), *blocks]


def block_bytes(header: KVHeader) -> list[int]:
    """The size in bytes of each of ``header``'s blocks."""
    layers, tokens, values = header.shape
    row = layers * values * torch.empty(0, dtype=_dtype(header)).element_size()
    bs = max(header.block_size, 1)
    return [row * min(bs, tokens - s) for s in range(0, max(tokens, 0), bs)]


def _dtype(header: KVHeader) -> torch.dtype:
    dtype = getattr(torch, header.dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(header.request_id, f"unknown KV dtype {header.dtype!r}")
    return dtype


def unpack(frames: list, layers: int, values: int, dtype: torch.dtype) -> Arrival:
    """Verify and decode a hand-off received as ``frames`` (bytes-like); raises
    :class:`~moeinfra.server.messages.BadFrame` when the first frame is no header, and
    :class:`TransferError` naming the request and what was wrong with the rest."""
    return verify(decode_kv_header(frames[0]), frames[1:], layers, values, dtype)


def verify(header: KVHeader, blocks: list, layers: int, values: int, dtype: torch.dtype) -> Arrival:
    """The arrival of ``header``'s hand-off from its ``blocks`` (bytes-like), checked against this
    unit's cache layout (``layers``, ``values``, ``dtype``): :class:`TransferError` naming the
    request and what was wrong."""
    rid = header.request_id
    shape, bs = header.shape, header.block_size
    if shape[0] != layers or shape[2] != values or header.dtype != str(dtype):
        raise TransferError(
            rid,
            f"KV layout {shape} {header.dtype} does not match this unit's "
            f"({layers}, tokens, {values}) {dtype}",
        )
    tokens = shape[1]
    if tokens < 1:
        raise TransferError(rid, f"KV for {tokens} tokens")
    if tokens != len(header.prompt_ids):
        raise TransferError(rid, f"KV for {tokens} tokens, prompt has {len(header.prompt_ids)}")
    if bs < 1:
        raise TransferError(rid, f"block_size={bs} must be >= 1")
    expected = -(-tokens // bs)
    if len(blocks) != expected or len(header.crc32) != expected:
        raise TransferError(rid, f"{len(blocks)} KV blocks arrived, {expected} expected")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    parts = []
    for i, (block, crc) in enumerate(zip(blocks, header.crc32, strict=True)):
        n = min(bs, tokens - i * bs)
        buf = memoryview(block)
        if buf.nbytes != layers * n * values * itemsize or zlib.crc32(buf) != crc:
            raise TransferError(rid, f"KV block {i} is damaged (size or checksum)")
        parts.append(np.frombuffer(buf, dtype=np.uint8).reshape(layers, n, values * itemsize))
    raw = np.concatenate(parts, axis=1)
    kv = torch.from_numpy(raw).view(dtype).reshape(layers, tokens, values)
    return Arrival(
        rid,
        header.prompt_ids,
        header.output_ids,
        header.params,
        Preloaded(0, kv),
        header.num_cached_tokens,
        raw.nbytes,
        header.drafts,
    )
