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
    add_serve_arguments,
    config_from_args,
    unknown_variables,
)

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
    probe.add_argument("target", nargs="?", default="127.0.0.1:50051", help="host:port")
    probe.add_argument("--service", default="", help="service name; empty: the whole server")
    probe.add_argument("--timeout", type=float, default=3.0, help="seconds (default %(default)s)")
    probe.add_argument("--tls-ca", help="PEM file of the CA to verify a TLS server with")
    probe.add_argument("--tls-cert", help="PEM client certificate, for a server asking for one")
    probe.add_argument("--tls-key", help="PEM key of --tls-cert")
    probe.add_argument(
        "--tls-server-name", help="the name the server's certificate carries, if not TARGET's"
    )
    return parser


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
    if args.command == "health":
        from ._health import check

        return asyncio.run(
            check(
                args.target,
                args.service,
                args.timeout,
                tls_ca=args.tls_ca,
                tls_cert=args.tls_cert,
                tls_key=args.tls_key,
                tls_server_name=args.tls_server_name,
            )
        )
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
