"""The words of the warm standby's reports on its stdout (``standby`` writes them, ``standby_handle``
reads them): ``warm`` once, ``serving PID`` per server it forked, ``exited PID CODE`` per server that
exited. Their own module so the two processes' sides share them without importing each other."""

from __future__ import annotations

WARM = "warm"
SERVING = "serving"
EXITED = "exited"
