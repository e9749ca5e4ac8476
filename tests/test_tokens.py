"""Tokens with roles: who may call what, rotation without a restart, nothing logged."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from mmcache.client import (
    MMCacheClient,
    PermissionDeniedError,
    UnauthenticatedError,
)
from mmcache.server import MMCacheServer
from mmcache.server._auth import parse_tokens
from mmcache.server._config import ConfigError
from mmcache.v1 import cache_pb2 as pb

from .conftest import Samples, sample, scrape, server_config, serving, store_of
from .items import image_item
from .raw import SERVICE, chunk, data_entry, header, tensor_spec

WRITE = "w" * 8 + "-write-token-0001"
READ = "r" * 8 + "-read-token-00001"
ADMIN = "a" * 8 + "-admin-token-0001"
TENANT = "t" * 8 + "-tenant-a-only-01"


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[tuple[MMCacheServer, Path]]:
    tokens = tmp_path / "tokens"
    tokens.write_text(
        f"# roles\nwrite {WRITE}\nread {READ}\nadmin {ADMIN}\nwrite {TENANT} a\nread {TENANT} a\n"
    )
    async with serving(tokens_file=str(tokens)) as server:
        yield server, tokens


def handled(samples: Samples, method: str, code: str) -> float:
    return sum(
        value
        for (name, labels), value in samples.items()
        if name == "grpc_server_handled_total"
        and dict(labels)["grpc_method"] == method
        and dict(labels)["grpc_code"] == code
    )


def connect(server: MMCacheServer, token: str | None, **kwargs: object) -> MMCacheClient:
    return MMCacheClient(
        f"127.0.0.1:{server.port}",
        token=token,
        follow=False,
        **kwargs,  # type: ignore[arg-type]
    )


async def test_each_role_may_call_its_methods_and_no_other(
    secured: tuple[MMCacheServer, Path],
) -> None:
    server, _ = secured
    async with connect(server, WRITE) as frontend:
        await frontend.get_and_update([image_item(1)], ["h"])
        with pytest.raises(PermissionDeniedError, match="Fetch needs a token of role read"):
            await frontend.fetch(["h"])
        with pytest.raises(PermissionDeniedError, match="Clear needs a token of role admin"):
            await frontend.clear_cache()
    async with connect(server, READ) as engine:
        (item,) = await engine.fetch(["h"])
        assert item == image_item(1)
        with pytest.raises(
            PermissionDeniedError, match=r"(GetAndUpdate|UpdateSession).* role write; this token"
        ):
            await engine.get_and_update([image_item(2)], ["g"])
        with pytest.raises(PermissionDeniedError, match="role admin"):
            await engine.encoder_cache("e0").create(cache_size=10)
    # The upload was refused as its session opened: counted, and not made again as a call.
    samples = await scrape(server.metrics_port)
    assert handled(samples, "UpdateSession", "PermissionDenied") == 1
    assert handled(samples, "GetAndUpdate", "PermissionDenied") == 0
    async with connect(server, ADMIN) as operator:
        await operator.get_and_update([image_item(2)], ["g"])
        assert len(await operator.fetch(["g", "h"])) == 2
        await operator.encoder_cache("e0").create(cache_size=10)
        await operator.clear_cache()
    assert len(store_of(server)) == 0


async def test_no_token_or_an_unknown_one_is_unauthenticated_with_the_role_needed(
    secured: tuple[MMCacheServer, Path],
) -> None:
    server, _ = secured
    with pytest.raises(UnauthenticatedError, match="needs a token of role"):
        async with connect(server, None):
            pass
    with pytest.raises(UnauthenticatedError, match="does not accept the token"):
        async with connect(server, "x" * 32):
            pass
    # Refusals are counted like any other status.
    samples = await scrape(server.metrics_port)
    refused = sample(
        samples,
        "grpc_server_handled_total",
        grpc_type="unary",
        grpc_service="mmcache.v1.MMCache",
        grpc_method="Info",
        grpc_code="Unauthenticated",
    )
    assert refused == 2


async def test_health_and_reflection_need_no_token(secured: tuple[MMCacheServer, Path]) -> None:
    server, _ = secured
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_token_limited_to_namespaces_may_use_only_those(
    secured: tuple[MMCacheServer, Path],
) -> None:
    server, _ = secured
    async with connect(server, TENANT, namespace="a") as mine:
        await mine.get_and_update([image_item(3)], ["h"])
        assert len(await mine.fetch(["h"])) == 1
    with pytest.raises(PermissionDeniedError, match="may not use namespace 'b'; it may use a"):
        async with connect(server, TENANT, namespace="b"):
            pass
    with pytest.raises(PermissionDeniedError, match="namespace '\\(default\\)'"):
        async with connect(server, TENANT):
            pass


async def test_tokens_rotate_without_a_restart(secured: tuple[MMCacheServer, Path]) -> None:
    server, tokens = secured
    new = "n" * 8 + "-rotated-write-01"
    with pytest.raises(UnauthenticatedError):
        async with connect(server, new):
            pass
    # Add the new token beside the old (as a Kubernetes Secret update swaps the file).
    staged = tokens.with_suffix(".new")
    staged.write_text(tokens.read_text() + f"write {new}\n")
    os.replace(staged, tokens)
    await asyncio.sleep(1.1)  # the file is looked at once a second
    async with connect(server, new) as client, connect(server, WRITE) as old:
        await client.get_and_update([image_item(4)], ["r"])
        await old.get_and_update([image_item(5)], ["o"])  # both work meanwhile
        # Retire the old one.
        staged.write_text(tokens.read_text().replace(f"write {WRITE}\n", ""))
        os.replace(staged, tokens)
        await asyncio.sleep(1.1)
        large = image_item(6, numel=4 << 20)  # 16 MiB: the client writes frames after the header
        with pytest.raises(UnauthenticatedError):
            await old.get_and_update([large], ["p"])
        await client.get_and_update([large], ["p"])
    # Refused at its next batch over the session kept open, and not sent again as a call:
    # the server read the batch to its end, so its refusal reached the client whole.
    samples = await scrape(server.metrics_port)
    assert handled(samples, "UpdateSession", "Unauthenticated") == 1
    assert handled(samples, "GetAndUpdate", "Unauthenticated") == 0


async def test_a_broken_tokens_file_keeps_the_known_tokens(
    secured: tuple[MMCacheServer, Path], caplog: pytest.LogCaptureFixture
) -> None:
    server, tokens = secured
    tokens.write_text("write short\n")  # half a rotation gone wrong
    await asyncio.sleep(1.1)
    with caplog.at_level(logging.WARNING):
        async with connect(server, WRITE) as client:
            await client.get_and_update([image_item(7)], ["k"])
    assert any("not reloaded" in r.getMessage() for r in caplog.records)


async def test_a_tokens_file_emptied_in_place_keeps_the_known_tokens(
    secured: tuple[MMCacheServer, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """`cat new > tokens` truncates first: for a moment the file lists nothing."""
    server, tokens = secured
    content = tokens.read_text()
    with caplog.at_level(logging.WARNING):
        tokens.write_text("")
        await asyncio.sleep(1.1)  # looked at, empty
        async with connect(server, WRITE) as client:
            await client.get_and_update([image_item(8)], ["e"])
    assert any("lists no token now" in r.getMessage() for r in caplog.records)
    # Once written, the file is read again: a token dropped from it is refused.
    tokens.write_text(content.replace(f"write {WRITE}\n", ""))
    await asyncio.sleep(1.1)
    with pytest.raises(UnauthenticatedError):
        async with connect(server, WRITE) as client:
            await client.get_and_update([image_item(9)], ["f"])


async def test_tokens_never_reach_the_log(
    secured: tuple[MMCacheServer, Path], caplog: pytest.LogCaptureFixture
) -> None:
    server, _ = secured
    wrong = "z" * 8 + "-wrong-token-0001"
    with caplog.at_level(logging.DEBUG):
        async with connect(server, READ) as engine:
            with pytest.raises(PermissionDeniedError):
                await engine.get_and_update([image_item(8)], ["x"])
        with pytest.raises(UnauthenticatedError):
            async with connect(server, wrong):
                pass
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "refused" in logged  # the refusals were logged, without the tokens
    for token in (READ, WRITE, ADMIN, wrong):
        assert token not in logged


def test_token_entries_are_checked_without_echoing_the_token() -> None:
    with pytest.raises(ConfigError, match="entry 1: role 'reader' is not one of") as bad_role:
        parse_tokens("reader abcdefghijklmnopqrstuvwxyz", "f")
    assert "abcdefghij" not in str(bad_role.value)
    with pytest.raises(ConfigError, match="16 to 512 characters, this one 5") as short:
        parse_tokens("write abcde", "f")
    assert "abcde'" not in str(short.value)
    grants = parse_tokens(f"write {WRITE} a,~ ; read {READ}", "env")
    assert [(g.role, g.namespaces) for g in grants] == [
        ("write", frozenset({"a", ""})),
        ("read", None),
    ]


async def test_a_server_with_an_empty_tokens_file_refuses_to_start(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# nobody\n")
    with pytest.raises(ConfigError, match="lists no token"):
        async with MMCacheServer(server_config(tokens_file=str(tokens))):
            pass


async def test_tokens_from_the_environment_setting(tmp_path: Path) -> None:
    async with (
        serving(tokens=f"write {WRITE}; read {READ}") as server,
        connect(server, WRITE) as frontend,
        connect(server, READ) as engine,
    ):
        await frontend.get_and_update([image_item(9)], ["e"])
        assert len(await engine.fetch(["e"])) == 1


async def test_the_plugins_client_fails_loudly_on_a_refused_token_and_open_on_silence(
    secured: tuple[MMCacheServer, Path],
) -> None:
    """A misconfigured token stops vLLM's start with the reason; a sidecar that is
    not there yet is no error (the plugin fails open)."""
    from mmcache.client.vllm.runtime import SyncClient

    server, _ = secured
    target = f"127.0.0.1:{server.port}"

    def make(token: str, at: str = target) -> None:
        SyncClient(at, deadline_s=0.5, token=token).close()

    with pytest.raises(UnauthenticatedError, match="does not accept the token"):
        await asyncio.to_thread(make, "y" * 32)
    assert not [t for t in threading.enumerate() if t.name == "mmcache-client"]  # nothing left
    await asyncio.to_thread(make, WRITE)
    await asyncio.to_thread(make, WRITE, "127.0.0.1:1")  # nothing listens: fails open


@pytest.mark.parametrize("sessions", [4, 0])
async def test_a_refused_call_leaves_no_stray_task_or_traceback(
    secured: tuple[MMCacheServer, Path], caplog: pytest.LogCaptureFixture, sessions: int
) -> None:
    """A refused upload (over a session, or as a call of its own) ends every
    task grpc made for it: nothing is reported when the call is collected."""
    import gc

    server, _ = secured
    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        async with connect(server, READ, sessions=sessions) as engine:  # a token without write
            for n in range(3):
                for item in (image_item(n, numel=300_000), image_item(n)):  # chunks, one frame
                    with pytest.raises(PermissionDeniedError):
                        await engine.get_and_update([item], [f"refused-{n}"])
        gc.collect()
        await asyncio.sleep(0.05)
        gc.collect()
    reported = [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]
    assert not reported, [r.getMessage() for r in reported]


async def test_a_refused_batch_that_never_ends_is_refused_within_the_skip_time(
    secured: tuple[MMCacheServer, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A batch refused at its header is read to its end before the refusal
    # (so its client reads it); one whose frames never come costs SKIP_S.
    monkeypatch.setattr("mmcache.server._sessions.SKIP_S", 0.5)
    server, tokens = secured
    spec = tensor_spec("float32", [4])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.stream_stream(f"{SERVICE}/UpdateSession")(
            metadata=(("authorization", f"Bearer {WRITE}"),)
        )
        await call.write(header(data_entry("a", spec, 1)))
        await call.write(chunk(bytes(16)))
        assert pb.UpdateReply.FromString(await call.read()).outcomes == [pb.OUTCOME_STORED]
        staged = tokens.with_suffix(".new")
        staged.write_text(tokens.read_text().replace(f"write {WRITE}\n", ""))
        os.replace(staged, tokens)
        await asyncio.sleep(1.1)  # the file is looked at once a second
        loop = asyncio.get_running_loop()
        started = loop.time()
        await call.write(header(data_entry("b", spec, 3)))  # three chunks said, one sent
        await call.write(chunk(bytes(16)))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert 0.4 < loop.time() - started < 3.0  # waited for the rest, then no longer
    assert "b" not in store_of(server)
