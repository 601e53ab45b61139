"""``python -m kvoffload.operator``: the command line is ``cli``'s."""

import sys

from kvoffload.operator.cli import main

if __name__ == "__main__":
    sys.exit(main())
