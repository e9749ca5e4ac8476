"""Server settings: flags, each also readable from an environment variable."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "GIB",
    "ServerConfig",
    "add_serve_arguments",
    "config_from_args",
    "default_max_items",
    "parse_serve_args",
]

GIB = 1 << 30
MIB = 1 << 20
T = TypeVar("T")


def default_max_items(capacity_bytes: int) -> int:
    """The item bound when none is given: 65536, plus one per 8 KiB of capacity.

    An item's size counts only its data; the server's bookkeeping for it
    (hash, spec, LRU entry) measured 1-2 KiB (bench/memory.py). At 2 KiB an
    item, this many items keep that bookkeeping within 128 MiB + capacity/4,
    inside the memory the deployment's sizing rule gives beyond the capacity
    (docs/deploy.md), while items averaging over 8 KiB never meet the bound.
    """
    return 65536 + capacity_bytes // 8192


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_host: str | None = None  # None: the same as host
    metrics_port: int = 9470
    capacity_bytes: int = 4 * GIB  # like vLLM's mm_processor_cache_gb default
    max_inflight_bytes: int = 1 * GIB
    max_items: int | None = None  # None: default_max_items(capacity_bytes)
    grace_s: float = 10.0
    lease_s: float = 30.0
    feed_buffer_bytes: int = 32 << 20
    reflection: bool = True
    log_level: str = "INFO"

    @property
    def item_bound(self) -> int:
        """The most items the cache holds: `max_items`, else the default for the capacity."""
        return default_max_items(self.capacity_bytes) if self.max_items is None else self.max_items


def _env(env: Mapping[str, str], name: str, parse: Callable[[str], T], default: T) -> T:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        raise SystemExit(
            f"mmcache: environment variable {name}={raw!r} is invalid: {exc}"
        ) from None


def _gib(raw: str) -> float:
    value = float(raw)
    if not value >= 0 or value == float("inf"):
        raise ValueError("must be a finite number of GiB >= 0")
    return value


def _mib(raw: str) -> float:
    value = float(raw)
    if not 0 < value <= 4096:
        raise ValueError("must be more than 0 and at most 4096 MiB")
    return value


def _port(raw: str) -> int:
    value = int(raw)
    if not 0 <= value <= 65535:
        raise ValueError("must be a port number 0-65535 (0 picks a free one)")
    return value


def _count(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("must be a whole number >= 1")
    return value


def _seconds(raw: str) -> float:
    value = float(raw)
    if not value >= 0:
        raise ValueError("must be >= 0 seconds")
    return value


def _lease_seconds(raw: str) -> float:
    value = float(raw)
    if not 0 < value <= 3600:
        raise ValueError("must be more than 0 and at most 3600 seconds")
    return value


def _bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be one of 1/0, true/false, yes/no, on/off")


def _argtype(parse: Callable[[str], T]) -> Callable[[str], T]:
    def convert(raw: str) -> T:
        try:
            return parse(raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{raw!r}: {exc}") from None

    convert.__name__ = parse.__name__.lstrip("_")
    return convert


def add_serve_arguments(
    parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None
) -> None:
    """The `serve` flags; defaults come from MMCACHE_* variables, then built-ins."""
    e = os.environ if env is None else env
    d = ServerConfig()
    parser.add_argument(
        "--host",
        default=e.get("MMCACHE_HOST") or d.host,
        help="address to serve gRPC on [env MMCACHE_HOST; default %(default)s]",
    )
    parser.add_argument(
        "--port",
        type=_argtype(_port),
        default=_env(e, "MMCACHE_PORT", _port, d.port),
        help="gRPC port, 0 for a free one [env MMCACHE_PORT; default %(default)s]",
    )
    parser.add_argument(
        "--metrics-host",
        default=e.get("MMCACHE_METRICS_HOST") or None,
        help="address of the /metrics endpoint [env MMCACHE_METRICS_HOST; default: --host]",
    )
    parser.add_argument(
        "--metrics-port",
        type=_argtype(_port),
        default=_env(e, "MMCACHE_METRICS_PORT", _port, d.metrics_port),
        help="Prometheus /metrics port [env MMCACHE_METRICS_PORT; default %(default)s]",
    )
    parser.add_argument(
        "--capacity-gb",
        type=_argtype(_gib),
        default=_env(e, "MMCACHE_CAPACITY_GB", _gib, d.capacity_bytes / GIB),
        help="cache capacity in GiB, fractions allowed, 0 disables caching "
        "[env MMCACHE_CAPACITY_GB; default %(default)s]",
    )
    parser.add_argument(
        "--max-inflight-gb",
        type=_argtype(_gib),
        default=_env(e, "MMCACHE_MAX_INFLIGHT_GB", _gib, d.max_inflight_bytes / GIB),
        help="GiB of uploads buffered at once beside the cache; more wait "
        "[env MMCACHE_MAX_INFLIGHT_GB; default %(default)s]",
    )
    parser.add_argument(
        "--max-items",
        type=_argtype(_count),
        default=_env(e, "MMCACHE_MAX_ITEMS", _count, d.max_items),
        help="most items held at once, whatever their bytes (each costs 1-2 KiB of "
        "bookkeeping an item's size does not count) [env MMCACHE_MAX_ITEMS; "
        "default 65536 + 1 per 8 KiB of capacity]",
    )
    parser.add_argument(
        "--lease-s",
        type=_argtype(_lease_seconds),
        default=_env(e, "MMCACHE_LEASE_S", _lease_seconds, d.lease_s),
        help="how long an item promised to a request stays readable if its engine never "
        "reads it [env MMCACHE_LEASE_S; default %(default)s]",
    )
    parser.add_argument(
        "--feed-buffer-mb",
        type=_argtype(_mib),
        default=_env(e, "MMCACHE_FEED_BUFFER_MB", _mib, d.feed_buffer_bytes / MIB),
        help="MiB of recent mirror-feed changes kept for subscribers that fall behind; one "
        "further behind gets a snapshot [env MMCACHE_FEED_BUFFER_MB; default %(default)s]",
    )
    parser.add_argument(
        "--grace-s",
        type=_argtype(_seconds),
        default=_env(e, "MMCACHE_GRACE_S", _seconds, d.grace_s),
        help="on SIGTERM, seconds for calls in flight to finish [env MMCACHE_GRACE_S; "
        "default %(default)s]",
    )
    parser.add_argument(
        "--reflection",
        action=argparse.BooleanOptionalAction,
        default=_env(e, "MMCACHE_REFLECTION", _bool, d.reflection),
        help="gRPC server reflection [env MMCACHE_REFLECTION; default on]",
    )
    parser.add_argument(
        "--log-level",
        default=e.get("MMCACHE_LOG_LEVEL") or d.log_level,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="[env MMCACHE_LOG_LEVEL; default %(default)s]",
    )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        capacity_bytes=int(args.capacity_gb * GIB),
        max_inflight_bytes=int(args.max_inflight_gb * GIB),
        max_items=args.max_items,
        grace_s=args.grace_s,
        lease_s=args.lease_s,
        feed_buffer_bytes=int(args.feed_buffer_mb * MIB),
        reflection=args.reflection,
        log_level=args.log_level,
    )


def parse_serve_args(argv: Sequence[str] | None = None) -> ServerConfig:
    parser = argparse.ArgumentParser(prog="mmcache serve")
    add_serve_arguments(parser)
    return config_from_args(parser.parse_args(argv))
