"""The tie from a child process to its parent (``PR_SET_PDEATHSIG``), set by every process the
sidecar starts: servers the supervisor starts cold, the warm standby, and the servers it forks."""

from __future__ import annotations

import contextlib
import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:  # pragma: no cover - runs in a forked child
    """Linux: this process gets SIGKILL when its parent dies without stopping it (a server when the
    sidecar or the standby that forked it dies, the standby when the sidecar does).

    The signal follows the *thread* that forked, so fork only from a long-lived thread.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
