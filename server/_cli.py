"""The `mmcache` command: `mmcache serve` runs the server, `mmcache health`
probes one (the container's health check)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

from mmcache import __version__

from ._config import (
    ConfigError,
    OneLineParser,
    ServerConfig,
    add_serve_arguments,
    config_from_args,
    unknown_variables,
)
from ._inspect import Connection, clear, get, locate, stats

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="mmcache", description="Remote cache of preprocessed multimodal inputs."
    )
    parser.add_argument("--version", action="version", version=f"mmcache {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    serve = commands.add_parser("serve", help="run the cache server")
    add_serve_arguments(serve)
    probe = commands.add_parser(
        "health", help="exit 0 when the server at TARGET reports SERVING (a health check)"
    )
    probe.add_argument("--service", default="", help="service name; empty: the whole server")
    _add_connection(probe, token=False)
    shown = commands.add_parser(
        "stats", help="items, bytes, hit ratio, leases, namespaces and L2 state of a server"
    )
    shown.add_argument(
        "--watch", type=_seconds, nargs="?", const=2.0, metavar="SECONDS",
        help="refresh in the terminal every SECONDS (2 when none is given; Ctrl-C stops)",
    )  # fmt: skip
    _add_connection(shown)
    where = commands.add_parser("locate", help="where each hash is held: here, only in L2, nowhere")
    where.add_argument("hashes", nargs="+", metavar="HASH", help="keys as clients send them")
    where.add_argument("--l2", action="store_true", help="also ask the L2 tier about the others")
    _add_connection(where, target_positional=False)
    fetched = commands.add_parser(
        "get", help="write an item's tensors and spec to a directory, to inspect"
    )
    fetched.add_argument("hash", metavar="HASH", help="the key as clients send it")
    fetched.add_argument("--out", required=True, metavar="DIR", help="directory to write into")
    _add_connection(fetched, target_positional=False)
    wipe = commands.add_parser(
        "clear", help="remove every item of a namespace (asks first; needs role admin)"
    )
    wipe.add_argument("--yes", action="store_true", help="do not ask")
    _add_connection(wipe, target_positional=False)
    return parser


def _seconds(text: str) -> float:
    """A pause of at least 0.1 s: 0 would ask the server without pause."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds >= 0.1:  # also NaN
        raise argparse.ArgumentTypeError(f"takes seconds, 0.1 or more, e.g. 2; got {text!r}")
    return seconds


def _add_connection(
    parser: argparse.ArgumentParser, *, token: bool = True, target_positional: bool = True
) -> None:
    """The server to call and how: as a client of it would (its variables too)."""
    default_target = os.environ.get("MMCACHE_TARGET", f"127.0.0.1:{ServerConfig.port}")
    if target_positional:
        parser.add_argument("target", nargs="?", default=default_target, help="host:port")
    else:
        parser.add_argument(
            "--target", default=default_target, help="host:port [env MMCACHE_TARGET]"
        )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default %(default)s)")
    if not token:  # (parser-level defaults beat an argument's: only where there is none)
        parser.set_defaults(sends_token=False, token_file=None, namespace="")
    else:
        parser.set_defaults(sends_token=True)
        parser.add_argument(
            "--token-file",
            default=os.environ.get("MMCACHE_TOKEN_FILE"),
            metavar="FILE",
            help="file holding the token [env MMCACHE_TOKEN_FILE, or MMCACHE_TOKEN]",
        )
        parser.add_argument(
            "--namespace",
            default=os.environ.get("MMCACHE_NAMESPACE", ""),
            help="the namespace to look at [env MMCACHE_NAMESPACE; default: the default one]",
        )
    parser.add_argument("--tls-ca", help="PEM file of the CA to verify a TLS server with")
    parser.add_argument("--tls-cert", help="PEM client certificate, for a server asking for one")
    parser.add_argument("--tls-key", help="PEM key of --tls-cert")
    parser.add_argument(
        "--tls-server-name", help="the name the server's certificate carries, if not TARGET's"
    )


def _connection(args: argparse.Namespace) -> Connection:
    token = (os.environ.get("MMCACHE_TOKEN") or None) if args.sends_token else None
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as file:
            token = file.read().strip()
    return Connection(
        args.target,
        token=token,
        namespace=args.namespace,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_server_name=args.tls_server_name,
        timeout=args.timeout,
    )


async def _inspect(args: argparse.Namespace) -> int:
    connection = _connection(args)
    if args.command == "stats":
        return await stats(connection, args.watch)
    if args.command == "locate":
        return await locate(connection, args.hashes, args.l2)
    if args.command == "get":
        return await get(connection, args.hash, args.out)
    return await clear(connection, args.yes)


class _EarlyStop:
    """A SIGTERM or SIGINT that arrives before the server's own handlers are in
    place (the imports and the start take a second): remembered, not lost. As
    a container's PID 1 the process would otherwise ignore it, and be killed
    only after the runtime's grace period."""

    requested = False

    @classmethod
    def install(cls) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, cls._note)

    @classmethod
    def _note(cls, signum: int, frame: object) -> None:
        cls.requested = True


def main(argv: Sequence[str] | None = None) -> int:
    serving = (sys.argv[1:] if argv is None else list(argv))[:1] == ["serve"]
    if serving:
        _EarlyStop.install()  # first of all
    args = _parser().parse_args(argv)
    if args.command in ("stats", "locate", "get", "clear"):
        try:
            return asyncio.run(_inspect(args))
        except OSError as exc:
            print(f"mmcache {args.command}: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # Ctrl-C: what a person asked for, no traceback
            print(file=sys.stderr)
            return 130
    if args.command == "health":
        from ._health import check

        return asyncio.run(check(_connection(args), args.service))
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"mmcache serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for line in unknown_variables(os.environ):
        logging.getLogger("mmcache.server").warning("%s", line)
    from ._app import serve

    return asyncio.run(serve(config, stop_requested=lambda: _EarlyStop.requested))


if __name__ == "__main__":
    sys.exit(main())
