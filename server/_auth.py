"""Tokens with roles, checked by one server interceptor.

A call carries `authorization: Bearer TOKEN`. Each method needs a role:

    write  frontends: GetAndUpdate(One), UpdateSession, Touch (and Release, Subscribe, Locate)
    read   engines:   Fetch (and Release, Subscribe, Locate; routers: Locate)
    admin  operators: Clear, every EncoderCache method; admin may call anything

Info needs any valid token; health and reflection need none (probes, and a
schema that is public anyway). A token is listed under each role it has,
optionally limited to some namespaces. Tokens come from a file (re-read when
it changes, so a new token can be added, clients moved to it and the old one
removed without a restart) and from MMCACHE_TOKENS. They are compared in
constant time against every token known, and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from mmcache import _errors as errors
from mmcache._spec import MAX_NAMESPACE_CHARS
from mmcache.v1 import cache_pb2 as pb
from mmcache.v1 import encoder_pb2 as epb

from ._config import ConfigError
from ._namespaces import namespace_name
from ._status import abort_with

__all__ = [
    "AUTHORIZATION_KEY",
    "ROLES",
    "AuthInterceptor",
    "Metadata",
    "TokenBook",
    "check_call",
    "parse_tokens",
    "required_roles",
]

_LOGGER = logging.getLogger(__name__)

AUTHORIZATION_KEY = "authorization"
ROLES = ("read", "write", "admin")
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 512
_RELOAD_EVERY_S = 1.0


def _methods() -> dict[str, frozenset[str]]:
    cache = pb.DESCRIPTOR.services_by_name["MMCache"]
    encoder = epb.DESCRIPTOR.services_by_name["EncoderCache"]
    needs = {
        "Info": frozenset(ROLES),
        "GetAndUpdate": frozenset({"write"}),
        "GetAndUpdateOne": frozenset({"write"}),
        "UpdateSession": frozenset({"write"}),
        "Touch": frozenset({"write"}),
        "ShmAllocate": frozenset({"write"}),
        "Fetch": frozenset({"read"}),
        "ReadShm": frozenset({"read"}),
        "Release": frozenset({"read", "write"}),
        "OpenReportRing": frozenset({"read", "write"}),  # what Release does, through the region
        "Subscribe": frozenset({"read", "write"}),
        "Locate": frozenset({"read", "write"}),
        "Clear": frozenset({"admin"}),
    }
    table = {f"/{cache.full_name}/{m.name}": needs[m.name] for m in cache.methods}
    table.update({f"/{encoder.full_name}/{m.name}": frozenset({"admin"}) for m in encoder.methods})
    return table


_REQUIRED = _methods()

Metadata = Iterable[tuple[str, str | bytes]] | None  # a call's invocation metadata


def required_roles(method: str) -> frozenset[str] | None:
    """The roles any one of which may call `method`; None: open to all (health, reflection)."""
    return _REQUIRED.get(method)


@dataclass(frozen=True, slots=True)
class Grant:
    role: str
    digest: bytes  # sha256 of the token: compared, never the token itself
    namespaces: frozenset[str] | None  # None: every namespace


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def parse_tokens(text: str, source: str) -> list[Grant]:
    """Entries `ROLE TOKEN [NAMESPACE,...]`, one per line or ';'-separated; '#' comments.

    Without namespaces a token may use every namespace; `~` names the default one.

    Errors name the source and entry, never the token.
    """
    grants = []
    entries = [e for line in text.splitlines() for e in line.split(";")]
    for number, raw in enumerate(entries, 1):
        entry = raw.split("#", 1)[0].split()
        if not entry:
            continue
        where = f"{source}, entry {number}"
        if len(entry) > 3:
            raise ConfigError(
                f"{where}: expected ROLE TOKEN [NAMESPACE,...], got {len(entry)} words"
            )
        role, token = entry[0].lower(), entry[1] if len(entry) > 1 else ""
        if role not in ROLES:
            raise ConfigError(f"{where}: role {entry[0]!r} is not one of {', '.join(ROLES)}")
        if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
            raise ConfigError(
                f"{where}: a token is {MIN_TOKEN_CHARS} to {MAX_TOKEN_CHARS} characters, this "
                f"one {len(token)} (make one with `openssl rand -hex 32`)"
            )
        if not token.isascii() or not token.isprintable():
            raise ConfigError(f"{where}: a token is printable ASCII (it travels in a header)")
        namespaces = None
        if len(entry) == 3:
            # `~` stands for the default namespace (no namespace can be spelt so).
            names = frozenset("" if n == "~" else n for n in entry[2].split(",") if n)
            if any(len(n) > MAX_NAMESPACE_CHARS for n in names):
                raise ConfigError(f"{where}: a namespace is at most {MAX_NAMESPACE_CHARS} chars")
            namespaces = names
        grants.append(Grant(role, _digest(token), namespaces))
    return grants


class TokenBook:
    """The tokens accepted now: from `path` (re-read on change) and `inline` text."""

    def __init__(
        self,
        path: str | None,
        inline: str | None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._path = path
        self._inline = parse_tokens(inline, "MMCACHE_TOKENS") if inline else []
        self._clock = clock
        self._from_file: list[Grant] = []
        self._stamp: tuple[int, int, int] | None = None
        self._checked = 0.0
        if path is not None:
            self._load(first=True)
        if not self._inline and not self._from_file:
            raise ConfigError(
                f"the tokens file {path} lists no token: every call would be refused"
                if path
                else "MMCACHE_TOKENS lists no token"
            )

    def __len__(self) -> int:
        return len(self._inline) + len(self._from_file)

    @property
    def limits_namespaces(self) -> bool:
        """Whether some token is limited to namespaces (tenants kept apart)."""
        return any(g.namespaces is not None for g in (*self._inline, *self._from_file))

    def grants(self, token: str) -> list[Grant]:
        """The grants of `token`: every entry is compared, so timing tells nothing."""
        self._maybe_reload()
        digest = _digest(token)
        found = []
        for grant in (*self._inline, *self._from_file):
            if hmac.compare_digest(grant.digest, digest):
                found.append(grant)
        return found

    def _maybe_reload(self) -> None:
        if self._path is None:
            return
        now = self._clock()
        if now - self._checked < _RELOAD_EVERY_S:
            return
        self._checked = now
        self._load(first=False)

    def _load(self, *, first: bool) -> None:
        assert self._path is not None
        try:
            info = os.stat(self._path)
            stamp = (info.st_ino, info.st_mtime_ns, info.st_size)
            if stamp == self._stamp:
                return
            with open(self._path, encoding="utf-8") as file:
                grants = parse_tokens(file.read(), self._path)
        except (OSError, UnicodeDecodeError, ConfigError) as exc:
            if first:
                raise ConfigError(f"cannot read the tokens file: {exc}") from None
            # Mid-rotation (a half-written file): keep serving the tokens known.
            _LOGGER.warning("tokens file not reloaded, keeping the %d known: %s", len(self), exc)
            return
        if not first and not grants and not self._inline:
            # A file rewritten in place (`cat > F`) is empty for a moment: that
            # must not lock every client out. Read again at the next check.
            _LOGGER.warning(
                "tokens file %s lists no token now; keeping the %d known (to revoke every "
                "token, stop the server; to rotate, replace the file atomically: write a "
                "new file and mv it over the old one)",
                self._path,
                len(self),
            )
            return
        if not first:
            _LOGGER.info("tokens file %s reloaded: %d tokens", self._path, len(grants))
        self._from_file, self._stamp = grants, stamp


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTHORIZATION_KEY:
            text = value if isinstance(value, str) else value.decode("ascii", "replace")
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def check_call(book: TokenBook, method: str, metadata: Metadata) -> errors.MMCacheError | None:
    """Why the call may not proceed, or None when it may."""
    needed = required_roles(method)
    if needed is None:
        return None
    name = method.rsplit("/", 1)[-1]
    needs = " or ".join(sorted(needed))
    token = _bearer(metadata)
    if not token:
        return errors.UnauthenticatedError(
            f"{name} needs a token of role {needs}: send 'authorization: Bearer TOKEN' "
            "(MMCacheClient(token=...); MMCACHE_TOKEN for the vLLM plugin)"
        )
    grants = book.grants(token)
    if not grants:
        return errors.UnauthenticatedError(
            f"{name}: this server does not accept the token sent (mistyped, or revoked); "
            f"it needs a token of role {needs}"
        )
    allowed = [g for g in grants if g.role == "admin" or g.role in needed]
    if not allowed:
        has = ", ".join(sorted({g.role for g in grants}))
        return errors.PermissionDeniedError(
            f"{name} needs a token of role {needs}; this token has role {has}"
        )
    try:
        namespace = namespace_name(metadata)
    except errors.InvalidArgumentError as exc:
        return exc
    if any(g.namespaces is None or namespace in g.namespaces for g in allowed):
        return None
    names = sorted({n or "(default)" for g in allowed for n in g.namespaces or ()})
    return errors.PermissionDeniedError(
        f"{name}: this token may not use namespace {namespace or '(default)'!r}; it may use "
        f"{', '.join(names)}"
    )


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls whose token lacks the method's role (UNAUTHENTICATED, PERMISSION_DENIED)."""

    def __init__(self, book: TokenBook, instance_id: str) -> None:
        self._book = book
        self._instance_id = instance_id

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # UNIMPLEMENTED, whoever asks
        refusal = check_call(
            self._book,
            handler_call_details.method,
            handler_call_details.invocation_metadata,
        )
        if refusal is None:
            return handler
        _LOGGER.debug("refused %s: %s", handler_call_details.method, type(refusal).__name__)
        return _refusing(handler, refusal, self._instance_id)


def _refusing(
    handler: grpc.RpcMethodHandler[Any, Any], refusal: errors.MMCacheError, instance_id: str
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same shape that answers the refusal without reading the request."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await abort_with(context, refusal, instance_id)

    # Raw bytes in: the refused request is never parsed.
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)
