"""How a prompt's KV blocks move from a prefill rank to a decode rank: the worker side of the
hand-off, shaped like vLLM's KV connectors (the router is the scheduler side: it picks the decode
rank, times the hand-off out and tells the prefill rank when its blocks may go).

Every hand-off starts with a :class:`~moeinfra.server.messages.KVHeader` on the ZeroMQ ``PUSH``
socket to the decode rank (:mod:`moeinfra.server.kv_transfer`); a connector decides where the
blocks go:

- ``zmq`` (:class:`ZmqConnector`): the blocks follow the header as frames of the same message.
- ``mooncake`` / ``mooncake-rdma`` (:class:`MooncakeConnector`): the prefill rank lends the blocks,
  back to back in memory registered with the Mooncake Transfer Engine (what SGLang's and vLLM's
  Mooncake connectors move KV with), and names its session and their address in the header; the
  decode rank reads them with one one-sided transfer (TCP, or RDMA where the cluster has it; no
  metadata server: ``P2PHANDSHAKE``) on a thread of its own, checks every block's CRC-32, and the
  router's :class:`~moeinfra.server.messages.Release` frees them. A lent buffer no release came
  for (the API server restarted) is freed after :data:`LENT_S`. Mooncake's transfers are neither
  encrypted nor authenticated: the command line refuses it with ``--secret-file``.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from moeinfra.errors import InputError
from moeinfra.server.kv_transfer import TransferError, block_bytes, blocks_of, header_of, pack
from moeinfra.server.messages import KVHeader, encode

CONNECTORS = ("zmq", "mooncake", "mooncake-rdma")
#: seconds a prefill rank keeps blocks lent to a remote reader no release came for
LENT_S = 300.0
INSTALL_HINT = (
    "pip install 'moeinfra[mooncake]' (mooncake-transfer-engine-non-cuda) and the system's "
    "libibverbs.so.1 (Debian/Ubuntu: apt-get install libibverbs1; needed even over TCP)"
)


class ZmqConnector:
    """The blocks travel as frames behind the header (nothing to release)."""

    name = "zmq"
    reads = False

    def frames(self, handoff, block_size: int) -> list:
        return pack(handoff, block_size)

    def release(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass


class MooncakeConnector:
    """Blocks lent in Mooncake-registered memory and read by the decode rank (see the module
    docstring). ``host``: this rank's address the peers reach it on; ``protocol``: ``tcp`` or
    ``rdma``."""

    reads = True

    def __init__(self, host: str, protocol: str = "tcp") -> None:
        engine_class = mooncake_engine()
        self.name = "mooncake" if protocol == "tcp" else f"mooncake-{protocol}"
        self.engine = engine_class()
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise InputError(
                f"--kv-connector={self.name}: the Mooncake transfer engine did not start on "
                f"{host} over {protocol}"
            )
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.lent: dict[str, tuple[np.ndarray, float]] = {}  # request id -> (blocks, lent at)
        self.lock = threading.Lock()  # (frames runs on the sender thread, release on the loop)

    def frames(self, handoff, block_size: int) -> list:
        lent, blocks = blocks_of(handoff.kv, block_size)
        address = lent.ctypes.data
        if self.engine.register_memory(address, lent.nbytes) != 0:
            raise TransferError(handoff.request_id, "Mooncake could not register its KV blocks")
        self._expire()
        with self.lock:
            self.lent[handoff.request_id] = (lent, time.monotonic())
        header = header_of(handoff, blocks, block_size, source=self.session, address=address)
        return [encode(header)]

    def fetch(self, header: KVHeader) -> list[memoryview]:
        """Read ``header``'s blocks from the prefill rank (blocking: the decode rank runs it on a
        thread), split into blocks for :func:`~moeinfra.server.kv_transfer.verify`."""
        sizes = block_bytes(header)
        buffer = np.empty(sum(sizes), dtype=np.uint8)
        if buffer.nbytes:
            if self.engine.register_memory(buffer.ctypes.data, buffer.nbytes) != 0:
                raise TransferError(header.request_id, "Mooncake could not register a buffer")
            try:
                status = self.engine.transfer_sync_read(
                    header.source, buffer.ctypes.data, header.address, buffer.nbytes
                )
            finally:
                self.engine.unregister_memory(buffer.ctypes.data)
            if status != 0:
                raise TransferError(
                    header.request_id,
                    f"reading its KV blocks from {header.source} over Mooncake failed "
                    f"(status {status}): the prefill rank is gone or released them",
                )
        view, out, at = memoryview(buffer), [], 0
        for size in sizes:
            out.append(view[at : at + size])
            at += size
        return out

    def release(self, request_id: str) -> None:
        with self.lock:
            lent = self.lent.pop(request_id, None)
        if lent is not None:
            self.engine.unregister_memory(lent[0].ctypes.data)

    def _expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            old = [rid for rid, (_, at) in self.lent.items() if now - at > LENT_S]
        for rid in old:
            self.release(rid)

    def close(self) -> None:
        for rid in list(self.lent):
            self.release(rid)


def mooncake_engine():
    """Mooncake's ``TransferEngine`` class, or InputError saying what to install."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as err:
        raise InputError(
            f"--kv-connector=mooncake needs the Mooncake Transfer Engine ({err}): {INSTALL_HINT}"
        ) from None
    return TransferEngine


def check_connector(name: str, secret_file) -> None:
    """Refuse a connector this host cannot run, or one that would bypass ``--secret-file``."""
    if name not in CONNECTORS:
        raise InputError(f"--kv-connector={name!r} must be one of {', '.join(CONNECTORS)}")
    if name == "zmq":
        return
    if secret_file is not None:
        raise InputError(
            f"--kv-connector={name}: Mooncake's transfers are neither encrypted nor "
            "authenticated, and --secret-file asks for both; use --kv-connector zmq with it"
        )
    mooncake_engine()


def make_connector(name: str, host: str):
    """The connector ``name`` (:data:`CONNECTORS`) of a rank reachable at ``host``."""
    if name == "zmq":
        return ZmqConnector()
    return MooncakeConnector(host, "tcp" if name == "mooncake" else name.removeprefix("mooncake-"))
