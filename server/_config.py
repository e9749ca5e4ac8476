"""Server settings: value objects, and one table of flags, each with an environment twin.

`ServerConfig` holds the process-wide settings and one value object per part
that has settings of its own (`TlsConfig`, `ShmConfig`, `L2Config`,
`EventsConfig`); each default is written once, on its dataclass field, and
each object checks its own invariants, so a config built in code (tests,
benches) is held to the same rules as one from the command line.

Every setting is one row of `SETTINGS` (flag, environment variable, parser,
field path such as "l2.timeout_s", help); the `serve` flags, the environment
and the defaults shown in --help are all read from it by one loop, at parse
time. A flag beats its variable, which beats the default.
"""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any, NoReturn

from .cache import DEFAULT_PREFIX, L2Settings, check_l2_url

__all__ = [
    "GIB",
    "PARTS",
    "SETTINGS",
    "ConfigError",
    "EventsConfig",
    "L2Config",
    "ServerConfig",
    "Setting",
    "ShmConfig",
    "TlsConfig",
    "add_serve_arguments",
    "assemble",
    "config_from_args",
    "default_max_items",
    "is_loopback",
    "parse_serve_args",
    "setting_paths",
]

GIB = 1 << 30
MIB = 1 << 20


class ConfigError(ValueError):
    """A setting, or a combination of settings, the server cannot run with."""


def default_max_items(capacity_bytes: int) -> int:
    """The item bound when none is given: 65536, plus one per 8 KiB of capacity.

    An item's size counts only its data; the server's bookkeeping for it
    (hash, spec, LRU entry) measured 1-2 KiB (bench/memory.py). At 2 KiB an
    item, this many items keep that bookkeeping within 128 MiB + capacity/4,
    inside the memory the deployment's sizing rule gives beyond the capacity
    (docs/deploy.md), while items averaging over 8 KiB never meet the bound.
    """
    return 65536 + capacity_bytes // 8192


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


@dataclass(frozen=True)
class TlsConfig:
    """The server's TLS: its certificate chain and key (PEM files), and the CAs
    whose client certificates it requires (mTLS), if any."""

    cert: str
    key: str
    client_ca: str | None = None


@dataclass(frozen=True)
class ShmConfig:
    """The shared-memory fast path for clients on this host (docs/shm.md)."""

    enabled: bool = True  # off: gRPC only
    dir: str = "/dev/shm"  # a tmpfs both containers mount
    bytes: int = 256 << 20  # the region, taken from the capacity
    group: int | None = None  # a group whose members may map the region (0660)

    def __post_init__(self) -> None:
        if self.enabled and self.bytes < MIB:
            raise ConfigError(f"the shared-memory region must be 1 MiB or more: {self.bytes}")


@dataclass(frozen=True)
class L2Config:
    """The L2 tier the fleet's sidecars share: a Redis Cluster (docs/l2.md)."""

    # redis://[user:password@]host:port[,host:port...] (rediss:// for TLS); or
    # memory://NAME, shared by the sidecars of one process (tests, trying it out)
    url: str
    # The tier's own defaults (server/cache/_tier.py's L2Settings), written there once.
    prefix: str = DEFAULT_PREFIX  # of every key: fleets sharing one cluster each take their own
    admit: str = L2Settings.admit  # "second": on a second sighting; "first": every new item
    timeout_s: float = L2Settings.timeout_s  # one L2 operation, at most
    wait_s: float = L2Settings.wait_s  # how long a call waits for an item another sidecar processes
    window_s: float = L2Settings.window_s  # how long a claim to process a cold item lasts
    ttl_s: float = L2Settings.ttl_s  # an item's TTL in L2 (0: none; maxmemory + allkeys-lru)
    queue_items: int = L2Settings.queue_items  # items waiting to be written, at most

    def __post_init__(self) -> None:
        try:
            check_l2_url(self.url)
        except ValueError as exc:
            raise ConfigError(f"--l2 {_without_password(self.url)!r}: {exc}") from None
        if self.admit not in ("first", "second"):
            raise ConfigError(f"--l2-admit must be first or second, got {self.admit!r}")
        for flag, seconds in (("--l2-timeout-ms", self.timeout_s),
                              ("--l2-wait-ms", self.wait_s),
                              ("--l2-window-s", self.window_s)):  # fmt: skip
            if not seconds > 0:
                raise ConfigError(f"{flag} must be more than 0")
        if self.ttl_s < 0 or self.queue_items < 1:
            raise ConfigError("--l2-ttl-s must be >= 0 and --l2-queue-items >= 1")
        problem = _prefix_problem(self.prefix)
        if problem:
            raise ConfigError(f"--l2-prefix {self.prefix!r} {problem}")


@dataclass(frozen=True)
class EventsConfig:
    """Item events for routers: a ZMQ PUB endpoint in vLLM's KV-event framing,
    and where subscribers ask for batches they missed (docs/l2.md)."""

    endpoint: str  # e.g. tcp://*:5557
    replay_endpoint: str | None = None  # e.g. tcp://*:5558; None: no replay
    topic: str = "mm-items"  # the first frame of every message


@dataclass(frozen=True)
class ServerConfig:
    """Everything `mmcache serve` can be told; invalid combinations raise ConfigError."""

    host: str = "0.0.0.0"
    port: int = 50051
    metrics_host: str | None = None  # None: the same as host
    metrics_port: int = 9470
    health_port: int | None = None  # a plaintext port serving only health (for TLS servers)
    capacity_bytes: int = 4 * GIB  # like vLLM's mm_processor_cache_gb default
    max_inflight_bytes: int = 1 * GIB
    max_items: int | None = None  # None: default_max_items(capacity_bytes)
    max_namespaces: int = 64
    max_sessions: int = 1024  # upload sessions open at once (~26 KiB each, idle)
    grace_s: float = 10.0
    lease_s: float = 30.0
    feed_buffer_bytes: int = 32 << 20
    tls: TlsConfig | None = None  # None: plaintext
    tokens_file: str | None = None
    tokens: str | None = None  # entries as in a tokens file, ';' between them
    shm: ShmConfig = ShmConfig()
    l2: L2Config | None = None  # None: no L2 tier
    events: EventsConfig | None = None  # None: no item events
    reflection: bool = True
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.health_port is not None and self.health_port != 0:
            for name, other in (("--port", self.port), ("--metrics-port", self.metrics_port)):
                if other == self.health_port:
                    raise ConfigError(
                        f"--health-port {self.health_port} is also {name}: give it a port of "
                        "its own"
                    )
        if self.port != 0 and self.port == self.metrics_port:
            raise ConfigError(f"--port and --metrics-port are both {self.port}: give each its own")
        if self.max_items is not None and self.max_items < 1:
            raise ConfigError(f"max_items must be >= 1, got {self.max_items}")
        if self.capacity_bytes < 0 or self.max_inflight_bytes < 0:
            raise ConfigError("capacity and max in-flight bytes must be >= 0")
        if not 0 < self.lease_s <= 3600:
            raise ConfigError(f"lease_s must be more than 0 and at most 3600, got {self.lease_s}")

    @property
    def item_bound(self) -> int:
        """The most items the cache holds: `max_items`, else the default for the capacity."""
        return default_max_items(self.capacity_bytes) if self.max_items is None else self.max_items

    @property
    def verifies_clients(self) -> bool:
        """Whether clients must present a certificate (mTLS: --tls-client-ca)."""
        return self.tls is not None and self.tls.client_ca is not None

    @property
    def authenticates(self) -> bool:
        """Whether calls must carry a token (a tokens file or MMCACHE_TOKENS is set)."""
        return self.tokens_file is not None or bool(self.tokens)


# The parts of ServerConfig with settings of their own, by field name.
PARTS: dict[str, type[Any]] = {
    "tls": TlsConfig,
    "shm": ShmConfig,
    "l2": L2Config,
    "events": EventsConfig,
}


def setting_paths() -> list[str]:
    """Every setting's field: "port", or "part.field" ("l2.timeout_s") for a part's."""
    return [
        f"{field.name}.{inner.name}" if field.name in PARTS else field.name
        for field in fields(ServerConfig)
        for inner in (fields(PARTS[field.name]) if field.name in PARTS else [field])
    ]


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    return f"{scheme}{sep}<credentials hidden>@{rest.rpartition('@')[2]}"


def _prefix_problem(prefix: str) -> str:
    """What is wrong with an L2 key prefix ("" when nothing)."""
    if "{" in prefix or "}" in prefix:
        return (
            "holds a brace: Redis Cluster would take it for a hash tag; use letters, digits "
            "and : . _ -"
        )
    return ""


# -- parsers: raw text to the field's value; ValueError says what is allowed --


def _gib_to_bytes(raw: str) -> int:
    value = float(raw)
    if not value >= 0 or value == float("inf"):
        raise ValueError("must be a finite number of GiB >= 0")
    return int(value * GIB)


def _mib_to_bytes(raw: str) -> int:
    value = float(raw)
    if not 0 < value <= 4096:
        raise ValueError("must be more than 0 and at most 4096 MiB")
    return int(value * MIB)


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


def _milliseconds(raw: str) -> float:
    value = float(raw)
    if not 0 < value <= 60_000:
        raise ValueError("must be more than 0 and at most 60000 ms")
    return value / 1000


def _ms_shown(value: Any) -> str:
    return f"{value * 1000:g}"


def _admission(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ("first", "second"):
        raise ValueError("must be first (every new item) or second (on a second sighting)")
    return value


def _bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be one of 1/0, true/false, yes/no, on/off")


def _level(raw: str) -> str:
    value = raw.strip().upper()
    if value not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError("must be DEBUG, INFO, WARNING or ERROR")
    return value


def _text(raw: str) -> str:
    if not raw.strip():
        raise ValueError("must not be blank")
    return raw


def _key_prefix(raw: str) -> str:
    problem = _prefix_problem(_text(raw))
    if problem:
        raise ValueError(problem)
    return raw


def _region_bytes(raw: str) -> int:
    value = float(raw)
    if not 1 <= value <= 1 << 20:
        raise ValueError("must be 1 to 1048576 MiB")
    return int(value * MIB)


def _group(raw: str) -> int:
    if raw.isdigit():
        return int(raw)
    import grp

    try:
        return grp.getgrnam(raw).gr_gid
    except KeyError:
        raise ValueError("is no group of this system (give a name or a number)") from None


def _gib_shown(value: Any) -> str:
    return f"{value / GIB:g}"


def _mib_shown(value: Any) -> str:
    return f"{value / MIB:g}"


@dataclass(frozen=True)
class Setting:
    """One server setting: its flag (None: environment only), variable and field."""

    field: str  # ServerConfig's field, or a part's as "part.field" ("l2.timeout_s")
    flag: str | None
    env: str
    parse: Callable[[str], Any]
    help: str
    shown: Callable[[Any], str] = str  # the field's value as the flag would take it
    switch: bool = False  # --flag / --no-flag

    @property
    def default(self) -> Any:
        """The field's default, from its dataclass (None for a part's required field:
        the part is off until it is given)."""
        part, _, name = self.field.rpartition(".")
        owner = PARTS[part] if part else ServerConfig
        default = owner.__dataclass_fields__[name].default
        return None if default is MISSING else default

    def default_text(self) -> str:
        default = self.default
        return "none" if default is None else self.shown(default)

    @property
    def metavar(self) -> str:
        """What the flag takes, its unit first: GB, MB, MS, SECONDS, else its name."""
        assert self.flag is not None
        name = self.flag.lstrip("-")
        for suffix, unit in _UNITS.items():
            if name.endswith(suffix):
                return unit
        return name.rsplit("-", 1)[-1].upper()


# A flag's unit, from its name's end: its metavar, and the example a bad value gets.
_UNITS = {"-gb": "GB", "-mb": "MB", "-ms": "MS", "-s": "SECONDS"}
_EXAMPLES = {"GB": "4 or 0.5", "MB": "256", "MS": "500", "SECONDS": "30 or 2.5"}


SETTINGS: tuple[Setting, ...] = (
    Setting("host", "--host", "MMCACHE_HOST", _text, "address to serve gRPC on"),
    Setting("port", "--port", "MMCACHE_PORT", _port, "gRPC port, 0 for a free one"),
    Setting(
        "metrics_host",
        "--metrics-host",
        "MMCACHE_METRICS_HOST",
        _text,
        "address of the /metrics endpoint (none: --host)",
    ),
    Setting("metrics_port", "--metrics-port", "MMCACHE_METRICS_PORT", _port, "/metrics port"),
    Setting(
        "health_port",
        "--health-port",
        "MMCACHE_HEALTH_PORT",
        _port,
        "a plaintext port on --host serving only grpc.health.v1, for probes that cannot "
        "speak TLS (Kubernetes gRPC probes); none: health only on --port",
    ),
    Setting(
        "capacity_bytes",
        "--capacity-gb",
        "MMCACHE_CAPACITY_GB",
        _gib_to_bytes,
        "cache capacity in GiB, fractions allowed, 0 disables caching; namespaces share it",
        _gib_shown,
    ),
    Setting(
        "max_inflight_bytes",
        "--max-inflight-gb",
        "MMCACHE_MAX_INFLIGHT_GB",
        _gib_to_bytes,
        "GiB of uploads buffered at once beside the cache; more wait",
        _gib_shown,
    ),
    Setting(
        "max_items",
        "--max-items",
        "MMCACHE_MAX_ITEMS",
        _count,
        "most items held at once, whatever their bytes (each costs 1-2 KiB of bookkeeping "
        "an item's size does not count); none: 65536 + 1 per 8 KiB of capacity",
    ),
    Setting(
        "max_namespaces",
        "--max-namespaces",
        "MMCACHE_MAX_NAMESPACES",
        _count,
        "most namespaces with items or subscribers at once; a call naming one more is "
        "refused RESOURCE_EXHAUSTED",
    ),
    Setting(
        "max_sessions",
        "--max-sessions",
        "MMCACHE_MAX_SESSIONS",
        _count,
        "most upload sessions (streams clients keep open for their uploads) at once, about "
        "26 KiB each; a client refused one makes calls instead",
    ),
    Setting(
        "lease_s",
        "--lease-s",
        "MMCACHE_LEASE_S",
        _lease_seconds,
        "how long an item promised to a request stays readable if its engine never reads it",
    ),
    Setting(
        "feed_buffer_bytes",
        "--feed-buffer-mb",
        "MMCACHE_FEED_BUFFER_MB",
        _mib_to_bytes,
        "MiB of recent mirror-feed changes kept for subscribers that fall behind (per "
        "namespace with subscribers); one further behind gets a snapshot",
        _mib_shown,
    ),
    Setting(
        "grace_s",
        "--grace-s",
        "MMCACHE_GRACE_S",
        _seconds,
        "on SIGTERM, seconds for calls in flight to finish",
    ),
    Setting(
        "tls.cert",
        "--tls-cert",
        "MMCACHE_TLS_CERT",
        _text,
        "PEM file of the server's certificate chain; with --tls-key, serves TLS only",
    ),
    Setting("tls.key", "--tls-key", "MMCACHE_TLS_KEY", _text, "PEM file of the server's key"),
    Setting(
        "tls.client_ca",
        "--tls-client-ca",
        "MMCACHE_TLS_CLIENT_CA",
        _text,
        "PEM file of the CAs whose client certificates are accepted; requires one (mTLS)",
    ),
    Setting(
        "tokens_file",
        "--tokens-file",
        "MMCACHE_TOKENS_FILE",
        _text,
        "file of 'ROLE TOKEN [NAMESPACE,...]' lines (roles: read, write, admin); every "
        "call then needs a token; re-read when it changes",
    ),
    # Environment only: a token on the command line shows in `ps`.
    Setting(
        "tokens",
        None,
        "MMCACHE_TOKENS",
        _text,
        "tokens-file entries separated by ';'",
    ),
    Setting(
        "shm.enabled",
        "--shm",
        "MMCACHE_SHM",
        _bool,
        "the shared-memory fast path for clients on this host (docs/shm.md); off: gRPC only",
        lambda v: "on" if v else "off",
        switch=True,
    ),
    Setting(
        "shm.dir",
        "--shm-dir",
        "MMCACHE_SHM_DIR",
        _text,
        "directory of the shared-memory region (a tmpfs both containers mount); "
        "missing or unwritable: gRPC only",
    ),
    Setting(
        "shm.bytes",
        "--shm-mb",
        "MMCACHE_SHM_MB",
        _region_bytes,
        "MiB of the region: items co-located clients read with no call live there (out "
        "of the capacity, not beside it), and uploads pass through it; a quarter of the "
        "capacity holds a hot set",
        _mib_shown,
    ),
    Setting(
        "shm.group",
        "--shm-group",
        "MMCACHE_SHM_GROUP",
        _group,
        "group (name or id) whose members may map the region: 0660 instead of 0600",
    ),
    Setting(
        "l2.url",
        "--l2",
        "MMCACHE_L2",
        _text,
        "the L2 tier shared by the fleet's sidecars: a Redis Cluster, as "
        "redis://[user:password@]host:port[,host:port...] (rediss:// for TLS); items L1 "
        "lacks are read from it, items seen twice written to it (docs/l2.md); none: off",
    ),
    Setting(
        "l2.prefix",
        "--l2-prefix",
        "MMCACHE_L2_PREFIX",
        _key_prefix,
        "prefix of every L2 key: fleets (models) sharing one cluster each take their own",
    ),
    Setting(
        "l2.admit",
        "--l2-admit",
        "MMCACHE_L2_ADMIT",
        _admission,
        "which items are written to L2: second (seen a second time, here or by another "
        "sidecar) or first (every new item)",
    ),
    Setting(
        "l2.timeout_s",
        "--l2-timeout-ms",
        "MMCACHE_L2_TIMEOUT_MS",
        _milliseconds,
        "the longest one L2 operation may take; past it the call goes on without L2",
        _ms_shown,
    ),
    Setting(
        "l2.wait_s",
        "--l2-wait-ms",
        "MMCACHE_L2_WAIT_MS",
        _milliseconds,
        "how long a call waits for an item another sidecar is processing (single flight) "
        "before its own frontend processes it",
        _ms_shown,
    ),
    Setting(
        "l2.window_s",
        "--l2-window-s",
        "MMCACHE_L2_WINDOW_S",
        _lease_seconds,
        "how long a sidecar's claim to process a cold item lasts (once stored, its claim "
        "lasts as long as its cache holds the item)",
    ),
    Setting(
        "l2.ttl_s",
        "--l2-ttl-s",
        "MMCACHE_L2_TTL_S",
        _seconds,
        "TTL of items in L2; 0: none (the cluster's maxmemory with allkeys-lru evicts)",
    ),
    Setting(
        "l2.queue_items",
        "--l2-queue-items",
        "MMCACHE_L2_QUEUE_ITEMS",
        _count,
        "items waiting to be written to L2 at most; more are not written (counted)",
    ),
    Setting(
        "events.endpoint",
        "--events-endpoint",
        "MMCACHE_EVENTS_ENDPOINT",
        _text,
        "ZMQ endpoint to publish item events on (ItemStored, ItemRemoved, AllCleared in "
        "vLLM's KV-event framing), e.g. tcp://*:5557; none: off",
    ),
    Setting(
        "events.replay_endpoint",
        "--events-replay-endpoint",
        "MMCACHE_EVENTS_REPLAY_ENDPOINT",
        _text,
        "ZMQ endpoint where subscribers ask for item-event batches they missed, e.g. "
        "tcp://*:5558; none: no replay",
    ),
    Setting(
        "events.topic",
        "--events-topic",
        "MMCACHE_EVENTS_TOPIC",
        _text,
        "topic (first frame) of every item-event message",
    ),
    Setting(
        "reflection",
        "--reflection",
        "MMCACHE_REFLECTION",
        _bool,
        "gRPC server reflection",
        lambda v: "on" if v else "off",
        switch=True,
    ),
    Setting("log_level", "--log-level", "MMCACHE_LOG_LEVEL", _level, "DEBUG, INFO, WARNING, ERROR"),
)

assert sorted(s.field for s in SETTINGS) == sorted(setting_paths())


def _argtype(setting: Setting) -> Callable[[str], Any]:
    def convert(raw: str) -> Any:
        try:
            return setting.parse(raw)
        except ValueError as exc:
            why = str(exc)
            if why.startswith(("could not convert", "invalid literal")):
                example = _EXAMPLES.get(setting.metavar, "64")
                why = f"not a number: {setting.flag} takes {setting.metavar}, e.g. {example}"
            raise argparse.ArgumentTypeError(f"{raw!r}: {why}") from None

    convert.__name__ = setting.parse.__name__.lstrip("_")
    return convert


class OneLineParser(argparse.ArgumentParser):
    """A bad flag or value is one line saying what to change, not the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (`{self.prog} --help` lists every flag)\n")


# MMCACHE_* variables read elsewhere in the same environments (the client and
# the vLLM plugin, the deploy scripts): not a typo of a server setting.
OTHER_VARIABLES = frozenset(
    f"MMCACHE_{name}"
    for name in (
        "TARGET", "DEADLINE_S", "NAMESPACE", "TOKEN", "TOKEN_FILE", "TLS_CA",
        "TLS_SERVER_NAME", "SHM", "VLLM_UNTESTED", "VLLM_METRICS_PORT", "TEST_ENCODER_CALLS",
        "SINGLE_FLIGHT", "SHARE_SMALL", "UID", "TLS_DIR",
        "L2_MAXMEMORY", "IMAGE", "IMAGE_WORK", "BASE_IMAGE",
    )
)  # fmt: skip


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """A line for each MMCACHE_* variable no part of mmcache reads, with the
    setting it most likely meant: a typo otherwise changes nothing, silently."""
    known = {setting.env for setting in SETTINGS} | OTHER_VARIABLES
    lines = []
    for name in sorted(env):
        if name.startswith("MMCACHE_") and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            meant = f"; did you mean {close[0]}?" if close else ""
            lines.append(f"environment variable {name} is not an mmcache setting{meant}")
    return lines


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags. Unset ones stay absent: the environment is read at parse time."""
    for setting in SETTINGS:
        if setting.flag is None:
            continue
        help_text = f"{setting.help} [env {setting.env}; default {setting.default_text()}]"
        if setting.switch:
            parser.add_argument(
                setting.flag,
                dest=setting.field,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            parser.add_argument(
                setting.flag,
                dest=setting.field,
                type=_argtype(setting),
                metavar=setting.metavar,
                default=argparse.SUPPRESS,
                help=help_text.replace("%", "%%"),
            )


def config_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> ServerConfig:
    """Flags given, else their environment variables, else the defaults; checked."""
    environ = os.environ if env is None else env
    given = vars(args)
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        if setting.field in given:
            values[setting.field] = given[setting.field]
            continue
        raw = environ.get(setting.env, "")
        if raw == "":
            continue
        try:
            values[setting.field] = setting.parse(raw)
        except ValueError as exc:
            shown = "<hidden>" if setting.field == "tokens" else repr(raw)
            raise ConfigError(
                f"environment variable {setting.env}={shown} is invalid: {exc}"
            ) from None
    return assemble(values)


def assemble(values: Mapping[str, Any]) -> ServerConfig:
    """The config of settings given by field path ("port", "l2.timeout_s"); the
    others keep their defaults. A part that is off until its first field is given
    (TLS, L2, events) is None without it; its other settings alone change nothing
    (`--l2-prefix` without `--l2`), except where they would be a mistake."""
    top: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {name: {} for name in PARTS}
    for path, value in values.items():
        part, _, name = path.rpartition(".")
        (parts[part] if part else top)[name] = value
    tls, l2, events = parts["tls"], parts["l2"], parts["events"]
    if ("cert" in tls) != ("key" in tls):
        raise ConfigError(
            "--tls-cert and --tls-key go together: give both (the server's certificate "
            "chain and its private key) or neither"
        )
    if "client_ca" in tls and "cert" not in tls:
        raise ConfigError(
            "--tls-client-ca asks clients for certificates, which needs TLS: give "
            "--tls-cert and --tls-key too"
        )
    if "replay_endpoint" in events and "endpoint" not in events:
        raise ConfigError(
            "--events-replay-endpoint replays what --events-endpoint publishes: give both"
        )
    return ServerConfig(
        **top,
        tls=TlsConfig(**tls) if tls else None,
        shm=ShmConfig(**parts["shm"]),
        l2=L2Config(**l2) if "url" in l2 else None,
        events=EventsConfig(**events) if "endpoint" in events else None,
    )


def parse_serve_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> ServerConfig:
    parser = OneLineParser(prog="mmcache serve")
    add_serve_arguments(parser)
    return config_from_args(parser.parse_args(argv), env)
