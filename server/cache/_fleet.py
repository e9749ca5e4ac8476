"""The fleet protocol's state on this sidecar, in one place: what it knows of
each key (its claim, a write promised on store, whether L2 holds it), the
transitions the protocol makes on it, and the admission rule. No awaits and
no backend: `L2Tier` (server/cache/_tier.py) makes the calls and feeds their
answers here; `tests/test_fleet_model.py` checks the transitions against a
reference model.

A key's claim, as this sidecar sees it:

    NONE --claimed--> PROCESSING --stored--> HELD (admission: hold) or NONE
    PROCESSING --not_stored / window over--> NONE     (unclaim it in L2)
    HELD --removed (L1 evicted it) / another's hold--> NONE   (unclaim it)

Whatever the claim, `write_by` promises a write as soon as the item is stored
(another sidecar wants it, or L2's record was bad), and `known` says L2 holds
it (this sidecar wrote or read it), so it is not written again.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Admission", "Claim", "Job", "KeyBook"]


class Claim(enum.Enum):
    NONE = 0
    PROCESSING = 1  # claimed cold: this sidecar's frontend processes it
    HELD = 2  # stored here: this sidecar's claim lasts while L1 holds it


class Job(enum.Enum):
    """What the write-behind does for a key, as a transition asks."""

    NONE = 0
    WRITE = 1  # write it to L2, in turn
    URGENT = 2  # write it first: another sidecar waits for it
    HOLD = 3  # claim it in L2 (or extend the claim) while L1 holds it
    UNCLAIM = 4  # end this sidecar's claim in L2


class Admission:
    """Which stored items are written to L2: `second` (the default) writes an
    item seen a second time, here (a hit) or in the fleet (another sidecar
    asked for it while this one holds it: the hold says so); `first` writes
    every new item. Data sent over held data is written either way."""

    def __init__(self, rule: str) -> None:
        if rule not in ("first", "second"):
            raise ValueError(f"admission is 'first' or 'second', not {rule!r}")
        self.rule = rule

    def on_store(self, *, replaced: bool, known: bool) -> Job:
        if replaced or self.rule == "first":
            return Job.WRITE
        return Job.NONE if known else Job.HOLD

    def on_hit(self, *, known: bool) -> Job:
        return Job.NONE if known else Job.WRITE


@dataclass(slots=True)
class _Key:
    claim: Claim = Claim.NONE
    since: float = 0.0  # PROCESSING: when it was claimed
    write_by: float = 0.0  # write as soon as stored, until then (0: no)
    known: bool = False  # L2 holds it, as far as this sidecar knows


class KeyBook:
    """Per key, this sidecar's side of the protocol. At most `most` keys are
    kept (least recently touched out first; a HELD one so dropped is no
    longer tracked, so its claim ends: `on_dropped`)."""

    def __init__(
        self,
        admission: Admission,
        window_s: float,
        most: int,
        clock: Callable[[], float],
        on_dropped: Callable[[str], None],
    ) -> None:
        self._admission = admission
        self._window_s = window_s
        self._most = most
        self._clock = clock
        self._on_dropped = on_dropped
        self._keys: OrderedDict[str, _Key] = OrderedDict()
        self._claims = 0  # keys whose claim is not NONE

    def __len__(self) -> int:
        return len(self._keys)

    # -- what the protocol asks --

    def claim(self, key: str) -> Claim:
        state = self._keys.get(key)
        if state is None:
            return Claim.NONE
        if state.claim == Claim.PROCESSING and state.since < self._clock() - self._window_s:
            self._set(key, state, Claim.NONE)  # its window is over: nobody waits for it
        return state.claim

    def known(self, key: str) -> bool:
        state = self._keys.get(key)
        return state is not None and state.known

    @property
    def busy(self) -> bool:
        """Whether this sidecar holds any claim (its wants are taken more often)."""
        return self._claims > 0

    # -- transitions --

    def claimed(self, key: str) -> None:
        """This sidecar claimed the cold `key` (first to ask, or took it over)."""
        state = self._touch(key)
        state.since = self._clock()
        self._set(key, state, Claim.PROCESSING)

    def stored(self, key: str, *, replaced: bool) -> Job:
        """A client's data for `key` was stored in L1 (`replaced`: over data held)."""
        state = self._touch(key)
        due, state.write_by = 0.0 < state.write_by >= self._clock(), 0.0
        job = Job.URGENT if due else self._admission.on_store(replaced=replaced, known=state.known)
        if job == Job.HOLD:
            self._set(key, state, Claim.HELD)
        elif state.claim == Claim.PROCESSING:  # processed: the claim is done
            self._set(key, state, Claim.NONE)
        else:
            self._tidy(key, state)
        return job

    def not_stored(self, key: str) -> Job:
        """A client's data for `key` could not be stored: a claim of it ends."""
        if self.claim(key) != Claim.PROCESSING:
            return Job.NONE
        self._set(key, self._keys[key], Claim.NONE)
        return Job.UNCLAIM

    def removed(self, key: str) -> Job:
        """L1 no longer holds `key`: the claim of a held item ends."""
        if self.claim(key) != Claim.HELD:
            return Job.NONE
        self._set(key, self._keys[key], Claim.NONE)
        return Job.UNCLAIM

    def hit(self, key: str) -> Job:
        """L1 answered `key` held: a second sighting here."""
        return self._admission.on_hit(known=self.known(key))

    def write_when_stored(self, key: str) -> None:
        """Write `key` as soon as it is stored here, within the window."""
        self._touch(key).write_by = self._clock() + self._window_s

    def wanted(self, key: str, *, in_l1: bool) -> Job:
        """Another sidecar asked this one to write `key` (its want list)."""
        if in_l1:
            self.forget(key)  # asked for: L2 lacks it now
            return Job.URGENT
        if self.claim(key) == Claim.PROCESSING:  # written once stored
            self.write_when_stored(key)
            return Job.NONE
        return Job.UNCLAIM  # a claim left behind (an unclaim that failed)

    def hold_answered(self, key: str, *, others: bool, asked: int) -> Job:
        """L2 answered this sidecar's hold of `key`: `others`, another sidecar
        claims it (not this one's to hold); `asked`, how many asked for it."""
        if others and self.claim(key) == Claim.HELD:
            self._set(key, self._keys[key], Claim.NONE)
        return Job.URGENT if others or asked else Job.NONE

    def know(self, key: str) -> None:
        """L2 holds `key` now (written or read here)."""
        self._touch(key).known = True

    def forget(self, key: str) -> None:
        """L2 lacks `key` (evicted there): written again when seen again."""
        state = self._keys.get(key)
        if state is not None:
            state.known = False
            self._tidy(key, state)

    # -- the book --

    def _touch(self, key: str) -> _Key:
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _Key()
            while len(self._keys) > self._most:
                old_key, old = self._keys.popitem(last=False)
                if old.claim != Claim.NONE:
                    self._claims -= 1
                if old.claim == Claim.HELD:
                    self._on_dropped(old_key)
        else:
            self._keys.move_to_end(key)
        return state

    def _set(self, key: str, state: _Key, claim: Claim) -> None:
        self._claims += (claim != Claim.NONE) - (state.claim != Claim.NONE)
        state.claim = claim
        self._tidy(key, state)

    def _tidy(self, key: str, state: _Key) -> None:
        """A key that says nothing any more is not kept."""
        if state.claim == Claim.NONE and not state.known and not state.write_by:
            self._keys.pop(key, None)
