"""A client's tie to one server: the channel and its calls, the server's
instance as the mirror knows it, and the feed that keeps the mirror."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from mmcache._errors import DeadlineExceededError, InvalidArgumentError, UnavailableError

from ._feed import FeedFollower
from ._mirror import Mirror
from ._touch import OUT_OF_TOUCH, Touch
from .wire import (
    CHANNEL_OPTIONS,
    CacheTransport,
    ServerInfo,
    Tls,
    metadata_interceptors,
    open_channel,
)

__all__ = ["Connection"]

_NOT_CONNECTED = "the client is not connected: use `async with MMCacheClient(...)`"


class Connection:
    def __init__(
        self,
        target: str,
        touch: Touch,
        on_info: Callable[[ServerInfo], None],
        on_instance: Callable[[str], None],
        *,
        timeout: float,
        connect_timeout: float,
        sessions: int,
        tls: Tls | None,
        token: str | None,
        namespace: str,
        channel_options: Sequence[tuple[str, Any]],
        follow: bool,
        feed_gap_s: float = 0.0,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self._touch = touch
        self._on_info = on_info
        self._on_instance = on_instance
        self._connect_timeout = connect_timeout
        self._sessions = sessions
        self._credentials = None if tls is None else tls.channel_credentials()
        self._token = token
        self._interceptors = metadata_interceptors(token, namespace)
        named = () if tls is None else tls.channel_options()
        self._options = (*CHANNEL_OPTIONS, *named, *channel_options)
        self._follow = follow
        self._feed_gap_s = feed_gap_s
        self.mirror = Mirror()
        self.follower: FeedFollower | None = None
        self._follower_task: asyncio.Task[None] | None = None
        self._channel: grpc.aio.Channel | None = None
        self._transport: CacheTransport | None = None

    @property
    def connected(self) -> bool:
        return self._transport is not None

    @property
    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            raise RuntimeError(_NOT_CONNECTED)
        return self._channel

    @property
    def transport(self) -> CacheTransport:
        if self._transport is None:
            raise RuntimeError(_NOT_CONNECTED)
        return self._transport

    async def open(self) -> None:
        """Open the channel, learn the server's instance and capacity, start the
        feed; a server that does not answer is no error when failing open."""
        channel = open_channel(
            self.target, self._credentials, self._options, self._interceptors, self._token
        )
        self._channel = channel
        transport = self._transport = CacheTransport(channel, self.timeout, self._sessions)
        touch = self._touch
        try:
            info = await transport.info(
                timeout=touch.timeout if touch.fail_open else self._connect_timeout
            )
        except OUT_OF_TOUCH as exc:
            if not touch.fail_open:
                await self.close()
                raise UnavailableError(
                    f"cannot reach the mmcache server at {self.target} ({exc}): is it "
                    "running there, and do the TLS settings match (a TLS server needs "
                    "tls=Tls(ca=...), one asking for client certificates also Tls(cert=..., "
                    "key=...); a plaintext server none)?"
                ) from exc
            touch.fell_open(exc)
        except BaseException:
            await self.close()
            raise
        else:
            self.mirror = Mirror(info.instance_id, info.capacity_bytes, info.max_items)
            touch.back()
            self._on_info(info)
        if self._follow:
            self.follower = FeedFollower(
                functools.partial(transport.subscribe, self._feed_gap_s),
                lambda: self.mirror,
                touch.back,
                self._on_instance,
            )
            self._follower_task = asyncio.create_task(self.follower.run())

    async def close(self) -> None:
        if self._transport is not None:
            await self._transport.close()
        if self._follower_task is not None:
            self._follower_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower_task
        self._follower_task = None
        self.follower = None
        if self._channel is not None:
            await self._channel.close()
        self._channel = None
        self._transport = None

    async def clear(self) -> None:
        """Clear the server's cache, and the mirror: a following mirror waits (at
        most 2 s) for the feed to bring the removals, so it keeps the leased
        items; otherwise it forgets everything."""
        reply = await self.transport.clear()
        mirror = self.mirror
        deadline = asyncio.get_running_loop().time() + 2.0
        while mirror.following and mirror.instance_id == reply.instance_id:
            if mirror.feed_seq >= reply.seq:
                return
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.002)
        mirror.clear(reply.instance_id)

    async def wait_following(self, timeout: float) -> None:
        if self.follower is None:
            raise InvalidArgumentError("this client does not follow the feed (follow=False)")
        try:
            await asyncio.wait_for(self.follower.live.wait(), timeout)
        except TimeoutError:
            raise DeadlineExceededError(
                f"the mirror feed was not live within {timeout}s: is the server reachable?"
            ) from None
