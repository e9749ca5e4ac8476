"""The lease book: grants per hash, released by reads, ended by time."""

from __future__ import annotations

from mmcache.server.cache._leases import LeaseBook


class Pins:
    """What the book pins and unpins, as the store's LRU would see it."""

    def __init__(self, held: set[str]) -> None:
        self.held = held
        self.pinned: set[str] = set()

    def pin(self, key: str) -> bool:
        if key in self.held:
            self.pinned.add(key)
            return True
        return False

    def unpin(self, key: str) -> None:
        self.pinned.discard(key)


def book(held: set[str], lease_s: float = 10.0) -> tuple[LeaseBook, Pins]:
    pins = Pins(held)
    return LeaseBook(lease_s, pins.pin, pins.unpin), pins


def test_a_key_stays_pinned_until_its_last_grant_is_released() -> None:
    leases, pins = book({"a", "b"})
    leases.grant(["a", "a", "b", "ghost"], now=0)  # a key not held takes no grant
    assert len(leases) == 3 and pins.pinned == {"a", "b"}
    assert leases.release(["a", "b", "ghost"]) == 2
    assert pins.pinned == {"a"} and len(leases) == 1
    assert leases.release(["a"]) == 1 and pins.pinned == set() and len(leases) == 0


def test_grants_end_by_time_oldest_first() -> None:
    leases, pins = book({"a", "b"}, lease_s=10)
    leases.grant(["a"], now=0)
    leases.grant(["a", "b"], now=5)
    assert leases.expire(9.9) == 0
    assert leases.expire(10) == 1 and pins.pinned == {"a", "b"}
    assert leases.expire(15) == 2 and pins.pinned == set() and len(leases) == 0


def test_a_released_grant_is_not_expired_again() -> None:
    leases, pins = book({"a"}, lease_s=10)
    leases.grant(["a"], now=0)
    leases.grant(["a"], now=8)
    assert leases.release(["a"]) == 1  # the oldest goes
    assert leases.expire(12) == 0 and pins.pinned == {"a"}  # the one of t=8 runs to 18
    assert leases.expire(18) == 1 and pins.pinned == set()


def test_forget_drops_every_grant_of_a_removed_key() -> None:
    leases, _ = book({"a"})
    leases.grant(["a", "a"], now=0)
    leases.forget("a")
    assert len(leases) == 0 and "a" not in leases
    assert leases.release(["a"]) == 0 and leases.expire(100) == 0
