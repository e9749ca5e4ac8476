"""The keywords `MMCacheClient` took in 0.1, accepted in 0.2 with a
`DeprecationWarning` that names the new form, and removed in 0.3
(CHANGELOG.md's deprecation policy).

0.1's TLS keywords became `tls=Tls(...)`, its fail-open ones
`fail_open=FailOpen(...)`. They mean here what they meant then: TLS was on
when a CA, a client pair or credentials were given (a server name alone left
the channel plaintext), and the fail-open timeout applied only to a client
made with `fail_open=True`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from ._touch import FailOpen
from .wire import Tls

__all__ = ["translate"]

_TLS = {
    "tls_ca": "ca",
    "tls_cert": "cert",
    "tls_key": "key",
    "tls_server_name": "server_name",
    "credentials": "credentials",
}
_FAIL_OPEN = {"fail_open_timeout": "timeout_s", "on_fail_open": "on_fail_open"}


def translate(
    legacy: Mapping[str, Any], tls: Tls | None, fail_open: bool | FailOpen
) -> tuple[Tls | None, bool | FailOpen]:
    """`tls` and `fail_open` with 0.1's keywords in `legacy` folded in; a
    TypeError for a keyword no release took, or for both forms at once."""
    for name in legacy:
        if name not in _TLS and name not in _FAIL_OPEN:
            raise TypeError(f"MMCacheClient() got an unexpected keyword argument {name!r}")
    given = {_TLS[k]: v for k, v in legacy.items() if k in _TLS and v is not None}
    if given:
        if tls is not None:
            raise TypeError("give MMCacheClient tls=Tls(...) or 0.1's tls_* keywords, not both")
        _warn([k for k in legacy if k in _TLS], _form("Tls", given))
        if set(given) != {"server_name"}:  # a server name alone: plaintext, as in 0.1
            tls = Tls(**given)
    timing = {_FAIL_OPEN[k]: v for k, v in legacy.items() if k in _FAIL_OPEN}
    if timing:
        if isinstance(fail_open, FailOpen):
            raise TypeError(
                "give MMCacheClient fail_open=FailOpen(...) or 0.1's fail_open_timeout and "
                "on_fail_open, not both"
            )
        _warn([k for k in legacy if k in _FAIL_OPEN], "fail_open=" + _form("FailOpen", timing))
        if fail_open:  # 0.1 read them only when failing open
            fail_open = FailOpen(**timing)
    return tls, fail_open


def _form(kind: str, values: Mapping[str, Any]) -> str:
    return f"{kind}({', '.join(f'{k}={v!r}' for k, v in values.items())})"


def _warn(old: list[str], new: str) -> None:
    names = ", ".join(f"{k}=" for k in old)
    warnings.warn(
        f"MMCacheClient({names}) is deprecated since mmcache 0.2 and goes in 0.3: "
        f"pass {'tls=' if new.startswith('Tls') else ''}{new} instead (CHANGELOG.md)",
        DeprecationWarning,
        stacklevel=4,  # the caller of MMCacheClient(...)
    )
