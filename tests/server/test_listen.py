"""The API server's listening socket: accepted connections send small writes at once."""

from __future__ import annotations

import socket

import pytest

from moeinfra.errors import InputError
from moeinfra.server.launch import _listen


def test_accepted_connections_have_tcp_nodelay():
    """Without TCP_NODELAY a streamed response's second small write waits for the client's
    delayed ACK (~40 ms per request on a kept-alive connection); asyncio sets it only on sockets
    created with IPPROTO_TCP."""
    listener = _listen("127.0.0.1", 0)
    try:
        assert listener.proto == socket.IPPROTO_TCP
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        with client, accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert accepted.proto == socket.IPPROTO_TCP
    finally:
        listener.close()


def test_a_busy_port_is_named():
    listener = _listen("127.0.0.1", 0)
    try:
        port = listener.getsockname()[1]
        with pytest.raises(InputError, match=f"--port={port}"):
            _listen("127.0.0.1", port)
    finally:
        listener.close()
