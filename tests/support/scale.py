"""How many times each fault is injected: a CI-sized count by default, the full count for the soak.

``KVOFFLOAD_SOAK=1`` (set by ``make soak`` / ``python -m tests.reliability.soak``) selects the
counts the issue asks for; the default run exercises every fault class at a smaller count.
"""

from __future__ import annotations

import os

SOAK = os.environ.get("KVOFFLOAD_SOAK", "") not in ("", "0", "false")


def count(ci: int, soak: int) -> int:
    """``soak`` under the soak command, ``ci`` otherwise."""
    return soak if SOAK else ci
