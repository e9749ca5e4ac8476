"""A Release call, or a co-located client's record in its report ring, as
the data plane's `Report`. A ring's record is a serialised ReleaseRequest
the client wrote in shared memory: input like any call's."""

from __future__ import annotations

from google.protobuf.message import DecodeError

from mmcache._errors import InvalidArgumentError
from mmcache.v1 import cache_pb2 as pb

from .cache import Report

__all__ = ["parse_report", "report_of"]


def report_of(request: pb.ReleaseRequest) -> Report:
    return Report(  # copies: no protobuf container reaches the data plane
        mm_hashes=tuple(request.mm_hashes),
        shm_token=request.shm_token,
        shm_read_bytes=request.shm_read_bytes,
        shm_done=tuple(request.shm_done),
        misses=dict(request.misses),
        hits=dict(request.hits),
        shm_leases=[(lease.mm_hash, lease.generation) for lease in request.shm_leases],
        client_cpu_ns=request.client_cpu_ns,
        upload=request.upload,
    )


def parse_report(record: bytes) -> Report:
    """A ring's record; InvalidArgumentError when it is not a ReleaseRequest."""
    try:
        return report_of(pb.ReleaseRequest.FromString(record))
    except DecodeError as exc:
        raise InvalidArgumentError(f"a report ring's record does not parse: {exc}") from None
