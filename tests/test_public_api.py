"""The client's public names, pinned: what README and docs import from
`mmcache.client` keeps working as the client's modules move, and the wire
layer (`mmcache.client.wire`) imports with torch absent, as the ops CLI
needs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import mmcache.client
import mmcache.client.wire

# Prose, not list literals: the names are the modules' own __all__ again.
CLIENT = """
AbortedError AllocateOp AlreadyExistsError BatchResult BatchedField CacheInfo
CacheMissError CanAllocateOp CheckAndUpdateCacheOp DeadlineExceededError EncoderBatch
EncoderBatchError EncoderBudget EncoderBudgetInputs EncoderCache EncoderCacheStats
EncoderOp FailOpen FailedPreconditionError FieldElem FlatField FreeEncoderInputOp FreeOp
GetCachedMmHashesOp GetFreedMmHashesOp InternalError InvalidArgumentError Location
MMCacheClient MMCacheError MMItem NotFoundError OpResult PermissionDeniedError ResetOp
ResidentLeases ResourceExhaustedError SharedField Tls UnauthenticatedError
UnavailableError
""".split()  # noqa: SIM905

WIRE = """
CHANNEL_OPTIONS MAX_SESSIONS Allocated CacheTransport Change Cleared FeedChanges
FeedMessage FeedSnapshot Fetched FetchedItem Leaf Lease Located RegionInfo Reply Report
ServerInfo Slot Spec TensorLeaf Tier Tls UpdateEntry broken_write connect describe
error_from_rpc error_from_status metadata_interceptors open_channel parse_fetched
parse_spec report_bytes translate_errors update_header
""".split()  # noqa: SIM905

# Where older code imports from; each keeps working.
FORMER_PATHS = {
    "mmcache.client._client": ["FailOpen", "MMCacheClient", "Tls", "UpdateResult"],
    "mmcache.client.vllm_plugin": ["register"],
}

ROOT = Path(__file__).resolve().parent.parent

NO_TORCH = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "numpy"):
            raise ImportError(f"{name} is not installed here")

sys.meta_path.insert(0, NoTorch())
import mmcache.client.wire
import mmcache.server._inspect
from mmcache.client import Tls, MMCacheError
assert "torch" not in sys.modules and "numpy" not in sys.modules
print("no torch")
"""


def test_the_clients_public_names_are_pinned_and_each_imports() -> None:
    assert mmcache.client.__all__ == CLIENT
    for name in CLIENT:
        assert getattr(mmcache.client, name) is not None, name
    assert set(CLIENT) <= set(dir(mmcache.client))


def test_the_wire_layers_names_are_pinned_and_each_imports() -> None:
    assert sorted(mmcache.client.wire.__all__) == sorted(WIRE)
    for name in WIRE:
        assert hasattr(mmcache.client.wire, name), name


def test_former_import_paths_still_work() -> None:
    for module, names in FORMER_PATHS.items():
        imported = __import__(module, fromlist=names)
        for name in names:
            assert hasattr(imported, name), f"{module}.{name}"
    assert mmcache.client.Tls is mmcache.client.wire.Tls


def test_a_missing_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchThing"):
        mmcache.client.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018


def test_the_wire_layer_and_the_ops_cli_import_without_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", NO_TORCH], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no torch"


def _imports_generated_code(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            names = [node.module or "", *(alias.name for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        if any(name.startswith("mmcache.v1") or name.endswith("_pb2") for name in names):
            return True
    return False


def test_only_the_wire_layer_imports_the_generated_code() -> None:
    client = ROOT / "client"
    importers = sorted(
        str(path.relative_to(client))
        for path in client.rglob("*.py")
        if _imports_generated_code(path)
    )
    assert importers, "the wire layer imports the generated code"
    assert all(path.startswith("wire/") for path in importers), importers
    assert len(importers) <= 6, importers
