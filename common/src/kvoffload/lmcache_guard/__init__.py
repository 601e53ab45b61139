"""The seam to the internals of LMCache's cache server wherever kvoffload runs one (the sidecar's
``kvoffload.sidecar.lmcache_server``, the connector's in-process backend). The connector's client side
has its own seam, ``kvoffload.connector.lmcache_seam``.

This package is the seam: here, the LMCache version it was written for (``check_lmcache_version``,
which every install below calls first) and ``install_server_guards`` (every replacement a server in
this process runs behind); in its modules, each part of LMCache's server it replaces
or reads:

- ``unpickling``: the restricted unpickler in place of LMCache's ``pickle.loads``;
- ``curve``: node mode's request port, admitting only the policy's client key;
- ``transfer_guard``: unfinished stores dropped, never admitted;
- ``retrieve_slots``: PREPARE_RETRIEVE's slots described from metadata, without a tensor view per chunk;
- ``request_logs``: LMCache's per-request INFO lines left out of the server's log;
- ``secured_lookups``: the server module that looks a hit up and secures it in one call, the prompt
  hashed once (``kvoffload.secured_lookup``; the sidecar's and the in-process server load it);
- ``cache_key_events``: what KV events for routers read (the event bus's cache-key events, the
  server's own chunk hashes);
- ``server_cli``: LMCache's own ``lmcache server`` command line, run warm in this process.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable
from typing import Any

SUPPORTED_LMCACHE_VERSIONS = ("0.5.6",)
"""LMCache releases kvoffload was checked against: the server internals this package replaces or reads,
and the private client names ``kvoffload.connector.lmcache_seam`` uses."""


class LMCacheVersionError(RuntimeError):
    """The installed LMCache is not one kvoffload was written for (or no longer has what it replaces)."""


def installed_lmcache_version() -> str:
    """The installed LMCache's version; raises ``LMCacheVersionError`` when none is installed."""
    try:
        return importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError as exc:
        raise LMCacheVersionError("LMCache is not installed") from exc


def check_lmcache_version(
    who: str = "server guard",
    what_to_do: str = "check where it unpickles before allowing it",
    version: str | None = None,
) -> str:
    """kvoffload's one LMCache version check: ``version`` (default: the installed one) when it is in
    ``SUPPORTED_LMCACHE_VERSIONS``, else ``LMCacheVersionError`` in one line naming both, ``who``
    refuses it and ``what_to_do``. The server guard, the KV-event module and the connector's seam call it."""
    version = installed_lmcache_version() if version is None else version
    if version not in SUPPORTED_LMCACHE_VERSIONS:
        raise LMCacheVersionError(
            f"LMCache {version} is installed; kvoffload's {who} was written for LMCache "
            f"{', '.join(SUPPORTED_LMCACHE_VERSIONS)} ({what_to_do})"
        )
    return version


def is_guard(value: object) -> bool:
    """Whether ``value`` is one of this package's replacements (marked by ``guarded``)."""
    return bool(getattr(value, "kvoffload_guard", False))


def guarded(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, marked as this package's replacement of an LMCache callable."""
    function.kvoffload_guard = True  # type: ignore[attr-defined]
    return function


def require_callables(needed: Iterable[tuple[Any, str]], what: str) -> None:
    """Raise ``LMCacheVersionError`` naming the first ``(owner, name)`` whose owner is missing or whose
    ``name`` is not callable on it: LMCache no longer has what ``what`` (a replacement) needs."""
    for owner, name in needed:
        if owner is None or not callable(getattr(owner, name, None)):
            raise LMCacheVersionError(f"LMCache no longer has the {name} {what}")


def install_server_guards() -> None:
    """Put every replacement of this package that an LMCache server in this process runs behind in
    place (the sidecar's server, the connector's in-process one): the restricted unpickler, the
    transfer guard and the retrieve slots; LMCache's per-request INFO lines left out of the log. Each
    checks the version first; each is idempotent."""
    from kvoffload.lmcache_guard.request_logs import quiet_per_request_lines
    from kvoffload.lmcache_guard.retrieve_slots import install_retrieve_slots
    from kvoffload.lmcache_guard.transfer_guard import install_transfer_guard
    from kvoffload.lmcache_guard.unpickling import install_restricted_unpickler

    install_restricted_unpickler()  # no client makes it run code
    install_transfer_guard()  # no store a worker did not finish is admitted
    install_retrieve_slots()  # a load is secured without a tensor view per chunk
    quiet_per_request_lines()  # no log line per request on the request's thread
