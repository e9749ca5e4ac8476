"""The fleet protocol's per-key state (server/cache/_fleet.py, `KeyBook`),
driven by hypothesis through every transition in any order, with time
passing, against a reference model written from the protocol's rules
(server/cache/_tier.py's docstring): the same claims, the same jobs asked of
the write-behind, the same knowledge of L2, after every step."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mmcache.server.cache._fleet import Admission, Claim, Job, KeyBook

KEYS = st.sampled_from(["a", "b", "c"])
WINDOW = 10.0


@dataclass
class Model:
    """The rules, stated plainly: no bounds, no ordering, no tidying."""

    rule: str
    now: float = 0.0
    claim: dict[str, Claim] = field(default_factory=dict)
    since: dict[str, float] = field(default_factory=dict)
    write_by: dict[str, float] = field(default_factory=dict)
    known: set[str] = field(default_factory=set)

    def claim_of(self, key: str) -> Claim:
        found = self.claim.get(key, Claim.NONE)
        if found == Claim.PROCESSING and self.since[key] < self.now - WINDOW:
            self.claim[key] = found = Claim.NONE  # the window is over
        return found

    def stored(self, key: str, replaced: bool) -> Job:
        urgent = self.write_by.pop(key, -1.0) >= self.now
        if urgent:
            job = Job.URGENT
        elif replaced or self.rule == "first":
            job = Job.WRITE
        else:
            job = Job.NONE if key in self.known else Job.HOLD
        if job == Job.HOLD:
            self.claim[key] = Claim.HELD
        elif self.claim.get(key) == Claim.PROCESSING:
            self.claim[key] = Claim.NONE
        return job

    def end(self, key: str, claim: Claim) -> Job:
        if self.claim_of(key) != claim:
            return Job.NONE
        self.claim[key] = Claim.NONE
        return Job.UNCLAIM

    def wanted(self, key: str, in_l1: bool) -> Job:
        if in_l1:
            self.known.discard(key)
            return Job.URGENT
        if self.claim_of(key) == Claim.PROCESSING:
            self.write_by[key] = self.now + WINDOW
            return Job.NONE
        return Job.UNCLAIM

    def hold_answered(self, key: str, others: bool, asked: int) -> Job:
        if others and self.claim_of(key) == Claim.HELD:
            self.claim[key] = Claim.NONE
        return Job.URGENT if others or asked else Job.NONE


class Protocol(RuleBasedStateMachine):
    @rule(admit=st.sampled_from(["first", "second"]))
    @precondition(lambda self: not hasattr(self, "book"))
    def start(self, admit: str) -> None:
        self.model = Model(admit)
        self.dropped: list[str] = []
        self.book = KeyBook(
            Admission(admit), WINDOW, 1000, lambda: self.model.now, self.dropped.append
        )

    def ready(self) -> bool:
        return hasattr(self, "book")

    @precondition(ready)
    @rule(seconds=st.floats(0, 2 * WINDOW))
    def time_passes(self, seconds: float) -> None:
        self.model.now += seconds

    @precondition(ready)
    @rule(key=KEYS)
    def claimed(self, key: str) -> None:
        self.book.claimed(key)
        self.model.claim[key], self.model.since[key] = Claim.PROCESSING, self.model.now

    @precondition(ready)
    @rule(key=KEYS, replaced=st.booleans())
    def stored(self, key: str, replaced: bool) -> None:
        assert self.book.stored(key, replaced=replaced) == self.model.stored(key, replaced)

    @precondition(ready)
    @rule(key=KEYS)
    def not_stored(self, key: str) -> None:
        assert self.book.not_stored(key) == self.model.end(key, Claim.PROCESSING)

    @precondition(ready)
    @rule(key=KEYS)
    def removed(self, key: str) -> None:
        assert self.book.removed(key) == self.model.end(key, Claim.HELD)

    @precondition(ready)
    @rule(key=KEYS)
    def hit(self, key: str) -> None:
        expected = Job.NONE if key in self.model.known else Job.WRITE
        assert self.book.hit(key) == expected

    @precondition(ready)
    @rule(key=KEYS)
    def write_when_stored(self, key: str) -> None:
        self.book.write_when_stored(key)
        self.model.write_by[key] = self.model.now + WINDOW

    @precondition(ready)
    @rule(key=KEYS, in_l1=st.booleans())
    def wanted(self, key: str, in_l1: bool) -> None:
        assert self.book.wanted(key, in_l1=in_l1) == self.model.wanted(key, in_l1)

    @precondition(ready)
    @rule(key=KEYS, others=st.booleans(), asked=st.integers(0, 2))
    def hold_answered(self, key: str, others: bool, asked: int) -> None:
        got = self.book.hold_answered(key, others=others, asked=asked)
        assert got == self.model.hold_answered(key, others, asked)

    @precondition(ready)
    @rule(key=KEYS, holds=st.booleans())
    def l2_says(self, key: str, holds: bool) -> None:
        if holds:
            self.book.know(key)
            self.model.known.add(key)
        else:
            self.book.forget(key)
            self.model.known.discard(key)

    @invariant()
    def the_same_state(self) -> None:
        if not self.ready():
            return
        for key in ("a", "b", "c"):
            assert self.book.claim(key) == self.model.claim_of(key), key
            assert self.book.known(key) == (key in self.model.known), key
        held = [k for k in ("a", "b", "c") if self.model.claim_of(k) != Claim.NONE]
        assert self.book.busy == bool(held)
        assert self.dropped == []  # far below the bound


TestProtocol = Protocol.TestCase
TestProtocol.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_the_book_is_bounded_and_a_held_key_it_drops_is_unclaimed() -> None:
    now = [0.0]
    dropped: list[str] = []
    book = KeyBook(Admission("second"), WINDOW, 3, lambda: now[0], dropped.append)
    assert book.stored("held", replaced=False) == Job.HOLD
    for key in ("k1", "k2", "k3"):
        book.know(key)
    assert len(book) == 3 and dropped == ["held"]
    assert book.claim("held") == Claim.NONE and not book.busy
    book.claimed("p")  # a claim whose window passes is over, and the key goes
    now[0] += WINDOW + 1
    assert book.claim("p") == Claim.NONE and len(book) == 2  # k1 made room for p; p is gone
