"""The mirror's rule: facts arrive out of order, the newest one wins.

A simulated server changes its key set; the mirror hears of it through
replies (each true at its own sequence number, delivered late and in any
order) and through the feed (in order, batched, delayed). Whatever the
interleaving, once everything has arrived the mirror is the server's state.
"""

from __future__ import annotations

import random

import pytest

from mmcache._lru import Outcome
from mmcache.client._mirror import Mirror
from mmcache.v1 import cache_pb2 as pb

KEYS = [f"k{i}" for i in range(8)]
BIG = 1 << 40


class Server:
    def __init__(self) -> None:
        self.seq = 0
        self.state: dict[str, int] = {}
        self.unflushed: list[tuple[int, str, int]] = []

    def change(self, rng: random.Random) -> None:
        key = rng.choice(KEYS)
        self.seq += 1
        if key in self.state and rng.random() < 0.5:
            del self.state[key]
            self.unflushed.append((pb.CHANGE_REMOVED, key, 0))
        else:
            size = rng.randint(1, 100)
            self.state[key] = size
            self.unflushed.append((pb.CHANGE_STORED, key, size))

    def flush(self) -> tuple[int, pb.FeedChanges]:
        kinds, keys, sizes = zip(*self.unflushed, strict=True)
        self.unflushed = []
        return self.seq, pb.FeedChanges(kinds=kinds, mm_hashes=keys, sizes=sizes)

    def reply(self, rng: random.Random) -> tuple[int, list[str], list[Outcome], list[int]]:
        keys = rng.sample(KEYS, rng.randint(1, 4))
        outcomes = [Outcome.HIT if k in self.state else Outcome.MISSING for k in keys]
        return self.seq, keys, outcomes, [self.state.get(k, 0) for k in keys]


@pytest.mark.parametrize("following", [True, False])
@pytest.mark.parametrize("seed", range(20))
def test_facts_in_any_order_leave_the_mirror_equal_to_the_server(
    seed: int, following: bool
) -> None:
    rng = random.Random(seed)
    server = Server()
    mirror = Mirror("i", BIG)
    if following:
        mirror.apply_snapshot("i", 0, [], [], [], BIG, 0)
    told: dict[str, tuple[int, bool]] = {}  # the newest reply's word on each key
    started: list[int] = []  # calls sent, not yet processed by the server
    replies: list[tuple[int, tuple[int, list[str], list[Outcome], list[int]]]] = []
    feed: list[tuple[int, pb.FeedChanges]] = []
    for _ in range(400):
        action = rng.random()
        if action < 0.4:
            server.change(rng)
        elif action < 0.55:
            started.append(mirror.call_started())
        elif action < 0.7 and started:  # the server answers a call: true now
            replies.append((started.pop(rng.randrange(len(started))), server.reply(rng)))
        elif action < 0.85 and replies:  # a reply arrives, in any order
            token, reply = replies.pop(rng.randrange(len(replies)))
            deliver(mirror, told, token, reply)
        elif following and server.unflushed and action < 0.92:
            feed.append(server.flush())
        elif following and feed:  # the feed arrives in order
            seq, changes = feed.pop(0)
            assert mirror.apply_changes("i", seq, changes)
    # Everything still under way arrives.
    for token in started:
        replies.append((token, server.reply(rng)))
    rng.shuffle(replies)
    for token, reply in replies:
        deliver(mirror, told, token, reply)
    if following:
        if server.unflushed:
            feed.append(server.flush())
        for seq, changes in feed:
            assert mirror.apply_changes("i", seq, changes)
        assert sorted(mirror.keys()) == sorted(server.state)
        assert all(mirror.size_of(k) == size for k, size in server.state.items())
    else:
        # Without the feed the mirror knows what replies told it, and for
        # each key the newest reply's word wins, whatever order they came in.
        assert sorted(mirror.keys()) == sorted(k for k, (_, held) in told.items() if held)


def deliver(
    mirror: Mirror,
    told: dict[str, tuple[int, bool]],
    token: int,
    reply: tuple[int, list[str], list[Outcome], list[int]],
) -> None:
    seq, keys, outcomes, sizes = reply
    mirror.apply_reply("i", BIG, 0, seq, keys, outcomes, sizes)
    mirror.call_ended(token)
    for key, outcome in zip(keys, outcomes, strict=True):
        if told.get(key, (-1, False))[0] <= seq:
            told[key] = (seq, outcome == Outcome.HIT)


def test_a_gap_in_the_feed_is_refused() -> None:
    mirror = Mirror("i", BIG)
    mirror.apply_snapshot("i", 5, ["a"], [1], [], BIG, 0)
    late = pb.FeedChanges(kinds=[pb.CHANGE_STORED], mm_hashes=["b"], sizes=[2])
    assert not mirror.apply_changes("i", 7, late)  # seq 6 never came
    assert mirror.apply_changes("i", 6, late) and "b" in mirror
    assert not mirror.apply_changes("other-instance", 7, late)


def test_a_snapshot_keeps_newer_facts_from_replies() -> None:
    mirror = Mirror("i", BIG)
    token = mirror.call_started()
    mirror.apply_reply("i", BIG, 0, 10, ["new", "gone"], [Outcome.STORED, Outcome.MISSING], [3, 0])
    # A snapshot taken at 8: before "new" was stored and while "gone" still was.
    mirror.apply_snapshot("i", 8, ["gone", "old"], [1, 1], ["up"], BIG, 0)
    mirror.call_ended(token)
    assert sorted(mirror.keys()) == ["new", "old"] and mirror.is_pending("up")


def test_an_older_snapshot_does_not_bring_back_what_replies_removed() -> None:
    mirror = Mirror("i", BIG)
    mirror.syncing = True  # subscribed; the snapshot is on its way
    for seq, outcome in ((3, Outcome.STORED), (7, Outcome.MISSING)):
        token = mirror.call_started()
        mirror.apply_reply("i", BIG, 0, seq, ["k"], [outcome], [5])
        mirror.call_ended(token)  # no call in flight: but the removal is kept
    mirror.apply_snapshot("i", 5, ["k"], [5], [], BIG, 0)  # shared, taken at 5
    assert "k" not in mirror


def test_pending_marks_come_and_go_with_the_feed() -> None:
    mirror = Mirror("i", BIG)
    mirror.apply_snapshot("i", 0, [], [], [], BIG, 0)
    kinds = [pb.CHANGE_PENDING, pb.CHANGE_STORED, pb.CHANGE_SETTLED]
    changes = pb.FeedChanges(kinds=kinds, mm_hashes=["x", "x", "x"], sizes=[0, 5, 0])
    assert mirror.apply_changes("i", 1, pb.FeedChanges(kinds=kinds[:1], mm_hashes=["x"], sizes=[0]))
    assert mirror.is_pending("x") and "x" not in mirror
    assert mirror.apply_changes("i", 3, changes)
    assert not mirror.is_pending("x") and mirror.size_of("x") == 5
    mirror.feed_lost()
    assert not mirror.following and "x" in mirror


def test_a_reply_newer_than_a_pending_mark_ends_it() -> None:
    # The feed says "pending" late: the upload's own reply (seq 4) came first.
    mirror = Mirror("i", BIG)
    mirror.apply_snapshot("i", 0, [], [], [], BIG, 0)
    mirror.apply_reply("i", BIG, 0, 4, ["x"], [Outcome.STORED], [5])
    mark = pb.FeedChanges(kinds=[pb.CHANGE_PENDING], mm_hashes=["x"], sizes=[0])
    assert mirror.apply_changes("i", 1, mark)
    assert not mirror.is_pending("x")
    # A mark newer than everything known stands until a newer fact.
    again = pb.FeedChanges(kinds=[pb.CHANGE_PENDING], mm_hashes=["y"], sizes=[0])
    assert mirror.apply_changes("i", 2, again) and mirror.is_pending("y")
    mirror.apply_reply("i", BIG, 0, 6, ["y"], [Outcome.MISSING], [0])
    assert not mirror.is_pending("y")


def test_a_new_instance_resets_the_mirror() -> None:
    mirror = Mirror("i", BIG)
    mirror.apply_reply("i", BIG, 0, 3, ["a"], [Outcome.STORED], [1])
    mirror.apply_reply("j", BIG, 0, 1, ["b"], [Outcome.STORED], [1])
    assert mirror.keys() == ["b"] and mirror.instance_id == "j"


def test_without_the_feed_the_mirror_keeps_within_the_servers_bounds() -> None:
    mirror = Mirror("i", 10, max_items=2)
    for n, key in enumerate("abc"):
        mirror.apply_reply("i", 10, 2, n + 1, [key], [Outcome.STORED], [4])
    assert mirror.keys() == ["b", "c"] and mirror.used == 8
