"""A shared secret for the server's ZeroMQ sockets: CurveZMQ encryption and authentication.

The API server's control socket and every decode rank's KV socket accept only peers that hold the
secret: each side derives CURVE key pairs from it (:meth:`CurveKeys.from_secret`, BLAKE2b of the
secret), the binding side is a CURVE server, the connecting side a CURVE client that must know
the server's public key to complete the handshake, and a ZAP handler admits only the client key
the secret gives. Traffic is then encrypted (prompts, outputs and KV blocks cross the network in
the clear otherwise). Peers without the secret never get a frame through; the binding side counts
and logs their failed handshakes.

A socket bound beyond loopback needs a secret (``--secret-file``) unless the operator says the
network is trusted (``--insecure``): see :func:`check_exposure`.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from moeinfra.errors import InputError

log = logging.getLogger(__name__)

#: The least secret length accepted (bytes, after stripping surrounding whitespace).
MIN_SECRET_BYTES = 16
ZAP_DOMAIN = "moeinfra"
#: Monitor events of a peer that did not complete the CURVE handshake.
_HANDSHAKE_FAILED = 0x0800 | 0x2000 | 0x4000


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded CURVE key pairs of the binding (server) and connecting (client) sides."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> CurveKeys:
        import zmq
        from zmq.utils import z85

        def pair(role: bytes) -> tuple[bytes, bytes]:
            private = z85.encode(hashlib.blake2b(secret, digest_size=32, person=role).digest())
            return zmq.curve_public(private), private

        server_public, server_secret = pair(b"moeinfra-server")
        client_public, client_secret = pair(b"moeinfra-client")
        return cls(server_public, server_secret, client_public, client_secret)


def read_secret(path: str | Path, option: str = "--secret-file") -> CurveKeys:
    """The keys of the secret in ``path``; a one-line :class:`InputError` when it is missing or
    too short."""
    path = Path(path)
    try:
        secret = path.read_bytes().strip()
    except OSError as err:
        raise InputError(f"{option}={path}: cannot be read ({err.strerror})") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise InputError(
            f"{option}={path}: holds {len(secret)} bytes, at least {MIN_SECRET_BYTES} are needed "
            "(e.g. openssl rand -hex 32 > FILE)"
        )
    return CurveKeys.from_secret(secret)


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ ``tcp://HOST:PORT`` address (or a bare host) stays on this machine."""
    host = urlsplit(address).hostname if "://" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(addresses: dict[str, str], keys: CurveKeys | None, insecure: bool) -> None:
    """Refuse to bind ``{option: address}`` beyond loopback without a secret (unless
    ``insecure``): anyone who reaches such a port could otherwise join as a unit and read
    prompts."""
    if keys is not None or insecure:
        return
    for option, address in addresses.items():
        if not is_loopback(address):
            raise InputError(
                f"{option}={address} is reachable beyond this machine: give --secret-file (the "
                "same secret on the API server and every unit) or --insecure on a trusted network"
            )


def serve_securely(socket, keys: CurveKeys) -> None:
    """Make ``socket`` (before it binds) a CURVE server under the secret."""
    socket.curve_secretkey = keys.server_secret
    socket.curve_publickey = keys.server_public
    socket.curve_server = True
    socket.zap_domain = ZAP_DOMAIN.encode()


def connect_securely(socket, keys: CurveKeys) -> None:
    """Make ``socket`` (before it connects) a CURVE client under the secret."""
    socket.curve_serverkey = keys.server_public
    socket.curve_publickey = keys.client_public
    socket.curve_secretkey = keys.client_secret


class _OneKey:
    """ZAP credentials: only the client key the secret gives."""

    def __init__(self, keys: CurveKeys) -> None:
        self.client_public = keys.client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.client_public


def authenticator(context, keys: CurveKeys, *, asyncio: bool = False):
    """A started ZAP handler on ``context`` that admits the secret's client key only (stop it
    before terminating the context)."""
    if asyncio:
        from zmq.auth.asyncio import AsyncioAuthenticator as Authenticator
    else:
        from zmq.auth.thread import ThreadAuthenticator as Authenticator
    auth = Authenticator(context, log=logging.getLogger(f"{__name__}.zap"))
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_OneKey(keys))
    return auth


def handshake_failures(event: int) -> bool:
    """Whether a socket monitor event is a peer that failed the handshake (no or another
    secret)."""
    return bool(event & _HANDSHAKE_FAILED)
