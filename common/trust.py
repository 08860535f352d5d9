"""Who may call a server: the cluster secret and mutual TLS (docs/deploy/security.md, "Trust").

A server checks every RPC but grpc.health.v1's (probes need it) for the cluster secret — call
metadata `pdserve-cluster-secret`, compared in constant time — and answers UNAUTHENTICATED
otherwise; with TLS files it also requires a client certificate signed by its CA. The router
opens its channels with `open_channel`, which puts the secret on every call made on them, so no
call site can forget it. The servers make no gRPC calls to each other (a prefill server learns
its destination, decode agent metadata included, from the router).

Neither protects the KV pages themselves: NIXL's UCX transport has no authentication, so whoever
reaches a decode server's UCX port and holds its agent metadata can WRITE into its pool. The
secret keeps that metadata (GetAgentMetadata, and every destination) from strangers; the
Kubernetes NetworkPolicy keeps strangers off the UCX ports; and a decode server acts only on a
notification that matches a destination it granted (decode/engine.py).

The flags are TrustConfig's (common/server_config.py); the environment is read here and nowhere else.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import grpc

from pdserve.common.server_config import TrustConfig

log = logging.getLogger(__name__)

SECRET_METADATA_KEY = "pdserve-cluster-secret"
SECRET_FILE_ENV = "PDSERVE_CLUSTER_SECRET_FILE"  # a path, for containers (a mounted Secret)
SECRET_ENV = "PDSERVE_CLUSTER_SECRET"  # the secret itself, where a file cannot be mounted
MIN_SECRET_CHARS = 16
_HEALTH_METHODS = "/grpc.health.v1.Health/"
_MAX_LOGGED_PEERS = 256  # callers refused are logged once each, up to this many


@dataclass(frozen=True)
class Trust:
    """TrustConfig resolved: the secrets and the TLS files' contents."""

    secrets: tuple[str, ...] = ()  # any is accepted; the first is the one sent
    tls_cert: bytes = b""
    tls_key: bytes = b""
    tls_ca: bytes = b""
    allow_unauthenticated: bool = False

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def authenticated(self) -> bool:
        return bool(self.secrets) or self.tls


def load_trust(config: TrustConfig, env: Mapping[str, str] = os.environ) -> Trust:
    """Read the secret (flag, else $PDSERVE_CLUSTER_SECRET_FILE, else $PDSERVE_CLUSTER_SECRET) and
    the TLS files; ValueError naming the flag or file for anything unusable."""
    path = config.cluster_secret_file or env.get(SECRET_FILE_ENV, "")
    if path:
        origin, text = path, _read(path, "cluster secret file").decode("ascii", errors="replace")
    elif env.get(SECRET_ENV):
        origin, text = f"${SECRET_ENV}", env[SECRET_ENV]
    else:
        origin, text = "", None
    found = _parse_secrets(text, origin) if text is not None else ()
    files = (config.tls_cert, config.tls_key, config.tls_ca)
    if any(files) and not all(files):
        raise ValueError("--tls-cert, --tls-key and --tls-ca go together (mutual TLS): give all three or none")
    cert, key, ca = (
        (_read(p, flag) for p, flag in zip(files, ("--tls-cert", "--tls-key", "--tls-ca")))
        if all(files)
        else (b"", b"", b"")
    )
    return Trust(found, cert, key, ca, config.allow_unauthenticated)


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path!r}: {e.strerror or e}") from None


def _parse_secrets(text: str, origin: str) -> tuple[str, ...]:
    lines = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not lines:
        raise ValueError(f"the cluster secret in {origin} is empty; make one with `openssl rand -hex 32`")
    for line in lines:
        # gRPC metadata values are printable ASCII; no spaces keeps copy-paste accidents out.
        if len(line) < MIN_SECRET_CHARS or not all("!" <= c <= "~" for c in line):
            raise ValueError(
                f"the cluster secret in {origin} must be at least {MIN_SECRET_CHARS} printable ASCII "
                "characters without spaces (one secret per line); make one with `openssl rand -hex 32`"
            )
    return lines


def write_secret_file(directory: str) -> str:
    """A fresh random secret in `directory`/cluster-secret, readable by this user only; its path
    (`pdserve up` and the bench's local stack make one per run)."""
    path = os.path.join(directory, "cluster-secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


# ---- who is exposed --------------------------------------------------------------------------


def host_of(address: str) -> str:
    """HOST of HOST:PORT or [V6]:PORT."""
    host = address.rpartition(":")[0] if ":" in address else address
    return host.strip("[]")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name (other than localhost) may resolve anywhere


def check_exposure(trust: Trust, hosts: Iterable[str], who: str) -> str | None:
    """None when every host is loopback or the calls are authenticated; with
    --allow-unauthenticated, the warning to log at start; else ValueError saying what to do.
    `who`: "listening on" (a server) or "reaching servers at" (the router)."""
    exposed = sorted({h for h in hosts if not is_loopback(h)})
    if not exposed or trust.authenticated:
        return None
    what = (
        f"{who} {', '.join(exposed)} without a cluster secret or TLS: anyone who reaches those ports can call "
        "every server RPC (read agent metadata, prefill into any decode page)"
    )
    if trust.allow_unauthenticated:
        return f"{what} (--allow-unauthenticated)"
    raise ValueError(
        f"{what}. Give --cluster-secret-file PATH (or ${SECRET_FILE_ENV}, or ${SECRET_ENV}) with the "
        "same secret to the router and every server, or --tls-cert/--tls-key/--tls-ca; "
        "--allow-unauthenticated only where the network itself is trusted"
    )


# ---- the server side -------------------------------------------------------------------------


class ClusterSecretCheck(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for every RPC without one of `secrets` in its metadata, health checks excepted.

    A refused call's request is never deserialized; `on_denied(method)` counts it, and each caller
    (its address) is logged once."""

    def __init__(self, accepted: tuple[str, ...], on_denied: Callable[[str], None] | None = None):
        self._accepted = tuple(s.encode() for s in accepted)
        self._on_denied = on_denied or (lambda method: None)
        self._logged: set[str] = set()

    def allows(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == SECRET_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else value
                # Every accepted secret is compared (compare_digest: time independent of where they differ).
                return sum(hmac.compare_digest(given, s) for s in self._accepted) > 0
        return False

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if details.method.startswith(_HEALTH_METHODS) or self.allows(details.invocation_metadata):
            return handler
        return self._refusal(handler, details.method)

    def _refusal(self, handler, method: str):
        async def refuse(request, context):
            self._on_denied(method)
            peer = (context.peer() or "?").rpartition(":")[0]  # without the port: once per caller
            if peer not in self._logged and len(self._logged) < _MAX_LOGGED_PEERS:
                self._logged.add(peer)
                log.warning(
                    "refused %s from %s: no valid %s (further refusals from it are only counted)",
                    method,
                    peer,
                    SECRET_METADATA_KEY,
                )
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method} needs the cluster secret (call metadata {SECRET_METADATA_KEY}; "
                'docs/deploy/security.md, "Trust")',
            )

        streaming = (handler.request_streaming, handler.response_streaming) if handler is not None else (False, False)
        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }
        return make[streaming](refuse)  # no deserializer: a refused request stays bytes


def server_interceptors(trust: Trust, on_denied: Callable[[str], None] | None = None) -> list:
    return [ClusterSecretCheck(trust.secrets, on_denied)] if trust.secrets else []


def add_port(server: grpc.aio.Server, address: str, trust: Trust) -> int:
    """Listen on `address` (mutual TLS when configured); the port bound, 0 on failure."""
    if not trust.tls:
        return server.add_insecure_port(address)
    credentials = grpc.ssl_server_credentials(
        [(trust.tls_key, trust.tls_cert)], root_certificates=trust.tls_ca, require_client_auth=True
    )
    return server.add_secure_port(address, credentials)


# ---- the client side -------------------------------------------------------------------------


def open_channel(address: str, trust: Trust, server_name: str = "") -> grpc.aio.Channel:
    """A channel to a server whose every call carries the secret, over mutual TLS when configured.
    `server_name`: the name its certificate must carry, when not the address's host (a pod IP
    found through a headless Service's DNS name)."""
    options = list(RECONNECT_OPTIONS)
    if trust.tls:
        credentials = grpc.ssl_channel_credentials(trust.tls_ca, trust.tls_key, trust.tls_cert)
        options += [("grpc.ssl_target_name_override", server_name)] if server_name else []
        channel = grpc.aio.secure_channel(address, credentials, options)
    else:
        channel = grpc.aio.insecure_channel(address, options)
    return SecretChannel(channel, trust.secrets[0]) if trust.secrets else channel


# NOTE: gRPC waits before reconnecting to an address that refused it, doubling the wait up to two
# minutes by default, and calls meanwhile fail at once: a server that came up (still starting when
# the router or `pdserve up` first called, or restarted) went unseen for ~10 s on the H200 host
# (docs/benchmarks/one-gpu.md, "One GPU"). Reconnect at least as often as the health checks run (1 s).
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


class SecretChannel(grpc.aio.Channel):
    """A channel whose calls all carry the cluster secret in their metadata.

    NOTE: not a grpc.aio client interceptor: grpc wraps every intercepted call in an object of its
    own and routes a stream's reads and writes through it (~25 us per stream message on the 2-core
    CPU box: bench/micro/rpc_auth.py, docs/benchmarks/README.md), while this adds one tuple per call and nothing
    per message. Stubs get their callables from unary_unary & co., so every stub on it is covered.
    """

    def __init__(self, channel: grpc.aio.Channel, secret: str):
        self._channel = channel
        self._metadata = ((SECRET_METADATA_KEY, secret),)

    def unary_unary(self, *args, **kwargs):
        return _WithSecret(self._channel.unary_unary(*args, **kwargs), self._metadata)

    def unary_stream(self, *args, **kwargs):
        return _WithSecret(self._channel.unary_stream(*args, **kwargs), self._metadata)

    def stream_unary(self, *args, **kwargs):
        return _WithSecret(self._channel.stream_unary(*args, **kwargs), self._metadata)

    def stream_stream(self, *args, **kwargs):
        return _WithSecret(self._channel.stream_stream(*args, **kwargs), self._metadata)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self._channel.close(None)

    async def close(self, grace: float | None = None):
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False):
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state):
        return await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self):
        return await self._channel.channel_ready()


class _WithSecret:
    """A multicallable that adds the secret to the call's metadata."""

    __slots__ = ("_call", "_metadata")

    def __init__(self, call, metadata: tuple):
        self._call, self._metadata = call, metadata

    def __call__(self, *args, metadata=None, **kwargs):
        metadata = self._metadata if metadata is None else (*self._metadata, *metadata)
        return self._call(*args, metadata=metadata, **kwargs)
