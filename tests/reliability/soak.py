"""The reliability soak: every fault at the full count of issue 8 (``make soak``).

    python -m tests.reliability.soak [extra pytest args]

Sets ``KVOFFLOAD_SOAK=1`` (tests/reliability/scale.py): 20 LMCache-server kills and 20 whole-sidecar
kills under a request stream, 50 operator changes with SIGKILLs, 5,000 fuzz examples per parser;
then runs the reliability suite with its measurements printed. About 25 minutes on a 2-core machine.
"""

from __future__ import annotations

import os
import subprocess
import sys


def main(argv: list[str]) -> int:
    env = {**os.environ, "KVOFFLOAD_SOAK": "1"}
    command = [sys.executable, "-m", "pytest", "-m", "reliability", "-s", "-p", "no:cacheprovider",
               "tests/reliability", "tests/unit/reliability", *argv]  # fmt: skip
    return subprocess.call(command, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
