"""COMMITs queued to be sent off the engine's path (``committer.Committer`` sends them), and what
lookups and session ends wait for among them (:class:`PendingCommits`).

After a store's or a load's copy (synchronised, so the KV is where it must be) the COMMIT that
publishes the store or releases the load's slots is sent by a committer thread while the engine goes
on, without holding the transfer lock during its round trip. Lookups in this process first wait for
the pending store COMMITs on their prompt's chain (bounded by the lookup timeout), and a request's
save is reported done only once its COMMITs were answered, so a request never misses KV that a
finished request stored. A COMMIT that fails marks the connection down like any other failed call.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload.connector.lmcache_seam import IPCCacheServerKey

Segment = tuple[str, int]
"""(shared-memory segment name, inode)."""

Chain = tuple[str, str, tuple[int, ...]]
"""(model, salt, first chunk's tokens): LMCache hashes a prompt's chunks as a chain from its first
chunk, so only a store on the same chain can change what a lookup finds."""


def chain_of(key: IPCCacheServerKey, chunk_size: int) -> Chain:
    """The chain the tokens of a lookup's or a store's ``key`` are on."""
    return (key.model_name, key.cache_salt, tuple(key.token_ids[:chunk_size]))


@dataclass(frozen=True)
class DeferredCommit:
    """A COMMIT the committer thread sends after the engine moved on."""

    operation: str
    transfer: Any
    key: IPCCacheServerKey
    chain: Chain | None = None
    """A store's chain (lookups on it wait for this COMMIT); None for a retrieve's."""
    segment: Segment | None = None
    """The server segment its PREPARE reserved in (None in pickle mode): the COMMIT goes to whichever
    connection reaches that segment's server, and nowhere once the server is gone."""
    on_done: Callable[[], None] | None = None
    """Called once the COMMIT was answered or dropped (a secured load's key is free again)."""


class PendingCommits:
    """COMMITs queued in this process and not yet answered, counted per session and per store chain.

    A lookup waits only for the stores on its own chain (it reads this process's writes without
    waiting for unrelated requests' COMMITs); a session's end waits only for that session's."""

    def __init__(self) -> None:
        self._count = 0
        self._by_tag: Counter[Hashable] = Counter()
        self._changed = threading.Condition()

    def add(self, commit: DeferredCommit) -> None:
        with self._changed:
            self._count += 1
            self._by_tag.update(self._tags(commit))

    def done(self, commit: DeferredCommit) -> None:
        with self._changed:
            self._count -= 1
            for tag in self._tags(commit):
                self._by_tag[tag] -= 1
                if self._by_tag[tag] <= 0:
                    del self._by_tag[tag]
            self._changed.notify_all()

    def wait_chain(self, chain: Chain, timeout_s: float) -> bool:
        """True when no store on ``chain`` is pending (at once, or within ``timeout_s``)."""
        return self._wait(("chain", chain), timeout_s)

    def wait_session(self, session_id: str, timeout_s: float) -> bool:
        """True when none of ``session_id``'s COMMITs is pending (at once, or within ``timeout_s``)."""
        return self._wait(("session", session_id), timeout_s)

    def session_pending(self, session_id: str) -> bool:
        """Whether a COMMIT of ``session_id`` is pending now (no waiting)."""
        with self._changed:
            return self._by_tag[("session", session_id)] > 0

    def wait_idle(self, timeout_s: float) -> bool:
        """True when no COMMIT at all is pending (at once, or within ``timeout_s``)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._count == 0, timeout=timeout_s)

    def sessions(self) -> list[str]:
        """The sessions with a COMMIT pending now (what a wait that timed out names)."""
        with self._changed:
            return sorted(
                str(tag[1])
                for tag, count in self._by_tag.items()
                if isinstance(tag, tuple) and tag[0] == "session" and count > 0
            )

    def _wait(self, tag: Hashable, timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._by_tag[tag] <= 0, timeout=timeout_s)

    @staticmethod
    def _tags(commit: DeferredCommit) -> list[Hashable]:
        tags: list[Hashable] = [("session", commit.key.request_id)]
        if commit.chain is not None:
            tags.append(("chain", commit.chain))
        return tags
