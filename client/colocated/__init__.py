"""The co-located path: a client on its server's host maps the server's
shared-memory region (docs/shm.md), uploads through write slots, reads and
leases resident items with no call, and reports what it did through a ring.

`CoLocated` is the client's one handle on it; with no region mapped (a
server on another host) every path goes over gRPC instead.

    _colocated.py   CoLocated: the mapping (from Info, again after a restart),
                    write slots, ReadShm, the reads and leases below
    _shm.py         ClientRegion: the mapped region, its index, extents, rings
    _plans.py       items decoded out of the region by a plan kept per spec
    _slots.py       WriteSlots: spare write slots kept for the next uploads
    _resident.py    ResidentHits: leases and reads with no call
    _reports.py     Reports: releases, holds done and counts, by ring or call
"""

from ._colocated import SHM_MIN_BYTES, CoLocated
from ._reports import Reports
from ._resident import ResidentHits, ResidentLeases
from ._shm import ClientRegion, ClientRing, Extent, attach
from ._slots import SPARE_BYTES, Size, WriteSlots

__all__ = [
    "SHM_MIN_BYTES",
    "SPARE_BYTES",
    "ClientRegion",
    "ClientRing",
    "CoLocated",
    "Extent",
    "Reports",
    "ResidentHits",
    "ResidentLeases",
    "Size",
    "WriteSlots",
    "attach",
]
