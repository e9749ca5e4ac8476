"""The vLLM releases the plugin and the EC connector were tested with.

vLLM's cache and connector interfaces change between minor releases, and a
plugin that loads into one it does not know could serve wrong data or fail
requests where it should say so at start. So on a release outside these the
plugin stays off (an ERROR naming the release and the tested ones; vLLM runs
with its own caches) and the EC connector fails the engine's start, unless
`MMCACHE_VLLM_UNTESTED=1` asks to try it anyway.
Patch releases and development builds of a known minor release are known.
"""

from __future__ import annotations

from ._settings import UNTESTED_ENV, Settings

__all__ = [
    "EC_RELEASES",
    "LEAST_VLLM",
    "PLUGIN_RELEASES",
    "UNTESTED_ENV",
    "refusal",
    "release_of",
    "require_supported_vllm",
]

# 0.31: NVIDIA Dynamo 1.6's pin (no release_sender_touches); 0.32, 0.33: the
# same cache interface (0.33 adds a queue of invalidations and decode budgets).
PLUGIN_RELEASES = ((0, 31), (0, 32), (0, 33))
# The EC connector interface it is written against (vLLM 0.32's), and the
# releases it was tested with.
LEAST_VLLM = (0, 32)
EC_RELEASES = ((0, 32), (0, 33))


def release_of(version: str) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string ("0.32.0", "0.33.1.dev3+g1a2b"), or None."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def refusal(
    what: str, version: str, known: tuple[tuple[int, int], ...], untested: bool
) -> str | None:
    """Why `what` will not run on vLLM `version` (None: it will); `untested`:
    run on any release (Settings.untested)."""
    if release_of(version) in known or untested:
        return None
    names = ", ".join(f"{major}.{minor}" for major, minor in known)
    return (
        f"{what} was not tested with vLLM {version} (tested: {names}): install a tested "
        f"vLLM or a newer mmcache, or set {UNTESTED_ENV}=1 to try it on this release anyway"
    )


def require_supported_vllm(version: str | None = None) -> None:
    """Refuse, at the engine's start and with what to do, a vLLM older than the
    EC connector's interface (its EC connector base differs, and requests
    would fail) or one it was not tested with."""
    import vllm

    found = version if version is not None else str(vllm.__version__)
    release = release_of(found)
    if release is not None and release < LEAST_VLLM:
        raise RuntimeError(
            f"mmcache's EC connector needs vLLM {'.'.join(map(str, LEAST_VLLM))} or later; "
            f"this is vLLM {found}. Use the processor-cache plugin alone there "
            "(MMCACHE_TARGET, without --ec-transfer-config), or upgrade vLLM."
        )
    why = refusal("mmcache's EC connector", found, EC_RELEASES, Settings.from_env().untested)
    if why is not None:
        raise RuntimeError(why)
