"""TLS and mTLS: real certificates (deploy/tls/make-certs.sh), real handshakes."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from mmcache.client import FailOpen, InvalidArgumentError, MMCacheClient, Tls, UnavailableError
from mmcache.server import TlsConfig

from .conftest import MMCACHE, connected, serving, store_of
from .items import image_item
from .test_fleet import _silent_listener
from .test_process import free_port, start, wait_serving


def tls_config(certs: Path, *, mtls: bool = False) -> TlsConfig:
    return TlsConfig(
        str(certs / "server.crt"),
        str(certs / "server.key"),
        client_ca=str(certs / "ca.crt") if mtls else None,
    )


async def test_items_round_trip_over_tls_with_the_ca_from_a_file(certs: Path) -> None:
    async with (
        serving(tls=tls_config(certs)) as server,
        connected(server, tls=Tls(ca=str(certs / "ca.crt"))) as client,
    ):
        item = image_item(1)
        await client.get_and_update([item], ["h"])
        (fetched,) = await client.fetch(["h"])
        assert fetched == item


async def test_credentials_object_works_as_well_as_file_paths(certs: Path) -> None:
    credentials = grpc.ssl_channel_credentials((certs / "ca.crt").read_bytes())
    async with (
        serving(tls=tls_config(certs)) as server,
        MMCacheClient(f"localhost:{server.port}", tls=Tls(credentials=credentials)) as client,
    ):
        await client.get_and_update([image_item(3)], ["c"])
        assert "c" in store_of(server)


async def test_a_plaintext_client_or_an_untrusted_ca_cannot_connect(
    certs: Path, rogue_certs: Path
) -> None:
    async with serving(tls=tls_config(certs)) as server:
        target = f"127.0.0.1:{server.port}"
        with pytest.raises(UnavailableError):
            async with MMCacheClient(target, connect_timeout=1, follow=False):
                pass
        with pytest.raises(UnavailableError):
            async with MMCacheClient(
                target, tls=Tls(ca=str(rogue_certs / "ca.crt")), connect_timeout=1, follow=False
            ):
                pass


async def test_mtls_needs_a_client_certificate_from_the_named_ca(
    certs: Path, rogue_certs: Path
) -> None:
    async with serving(tls=tls_config(certs, mtls=True)) as server:
        target = f"127.0.0.1:{server.port}"
        ca = str(certs / "ca.crt")
        with pytest.raises(UnavailableError):  # no certificate
            async with MMCacheClient(target, tls=Tls(ca=ca), connect_timeout=1, follow=False):
                pass
        with pytest.raises(UnavailableError):  # one from another CA
            async with MMCacheClient(
                target,
                tls=Tls(
                    ca=ca,
                    cert=str(rogue_certs / "client.crt"),
                    key=str(rogue_certs / "client.key"),
                ),
                connect_timeout=1,
                follow=False,
            ):
                pass
        async with MMCacheClient(
            target,
            tls=Tls(ca=ca, cert=str(certs / "client.crt"), key=str(certs / "client.key")),
        ) as client:
            await client.get_and_update([image_item(2)], ["m"])
            await client.wait_following()  # the feed stream runs over mTLS too
            assert client.is_cached("m")


def probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MMCACHE, "health", *args, "--timeout", "2"], capture_output=True, text=True, check=False
    )


def test_a_tls_server_process_keeps_its_probes_working(certs: Path) -> None:
    """The Kubernetes way (a plaintext health-only port) and the exec way (health over TLS)."""
    port, metrics_port, health_port = free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "MMCACHE_TLS_CERT": str(certs / "server.crt"),
        "MMCACHE_TLS_KEY": str(certs / "server.key"),
        "MMCACHE_TLS_CLIENT_CA": str(certs / "ca.crt"),
        "MMCACHE_HEALTH_PORT": str(health_port),
    }
    proc = start(
        [
            MMCACHE,
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
        ],
        env,
    )
    try:
        wait_serving(health_port, proc)  # the plaintext health-only port
        assert probe(f"127.0.0.1:{health_port}").returncode == 0
        mtls = [
            "--tls-ca",
            str(certs / "ca.crt"),
            "--tls-cert",
            str(certs / "client.crt"),
            "--tls-key",
            str(certs / "client.key"),
        ]
        assert probe(f"127.0.0.1:{port}", *mtls).returncode == 0
        assert probe(f"localhost:{port}", *mtls).returncode == 0
        plain = probe(f"127.0.0.1:{port}")  # no TLS: refused, with the reason
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "mTLS, no tokens" in err


def test_a_tls_flag_without_its_pair_is_refused_with_the_fix(certs: Path) -> None:
    result = subprocess.run(
        [MMCACHE, "serve", "--tls-cert", str(certs / "server.crt")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "--tls-cert and --tls-key go together" in result.stderr


def test_an_unreadable_certificate_is_refused_with_its_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.crt"
    result = subprocess.run(
        [
            MMCACHE,
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--tls-cert",
            str(missing),
            "--tls-key",
            str(missing),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert result.returncode == 2
    assert str(missing) in result.stderr and "--tls-cert" in result.stderr


def test_client_tls_and_fail_open_settings_are_checked_when_made(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="cert and key go together"):
        Tls(ca="ca.crt", cert="client.crt")
    with pytest.raises(InvalidArgumentError, match="not both"):
        Tls(ca="ca.crt", credentials=grpc.ssl_channel_credentials())
    with pytest.raises(InvalidArgumentError, match=str(tmp_path / "missing.crt")):
        MMCacheClient("127.0.0.1:1", tls=Tls(ca=str(tmp_path / "missing.crt")))
    with pytest.raises(InvalidArgumentError, match="timeout_s must be more than 0"):
        FailOpen(0)
    assert Tls(server_name="sidecar").channel_options() == (
        ("grpc.ssl_target_name_override", "sidecar"),
    )


async def test_01s_keywords_still_work_with_a_warning_naming_the_new_form(certs: Path) -> None:
    """0.2 keeps 0.1's constructor keywords for one minor release (CHANGELOG.md)."""
    ca = str(certs / "ca.crt")
    async with serving(tls=tls_config(certs)) as server:
        with pytest.warns(DeprecationWarning, match=r"pass tls=Tls\(ca='.*ca.crt'\) instead"):
            client = MMCacheClient(f"localhost:{server.port}", tls_ca=ca)
        async with client:
            await client.get_and_update([image_item(4)], ["old"])
        assert "old" in store_of(server)
    sock, port = _silent_listener()  # a server that never answers
    try:
        with pytest.warns(DeprecationWarning, match=r"fail_open=FailOpen\(timeout_s=0.25\)"):
            client = MMCacheClient(f"127.0.0.1:{port}", fail_open=True, fail_open_timeout=0.25)
        async with client:
            started = time.monotonic()
            assert list(await client.get_and_update([image_item(5)], ["a"])) == [image_item(5)]
            assert time.monotonic() - started < 2.0 and client.fail_opens >= 1
    finally:
        sock.close()
    with pytest.raises(TypeError, match="not both"):
        MMCacheClient("127.0.0.1:1", tls=Tls(ca=ca), tls_ca=ca)
    with pytest.raises(TypeError, match="unexpected keyword argument 'tls_cafile'"):
        MMCacheClient("127.0.0.1:1", tls_cafile=ca)
