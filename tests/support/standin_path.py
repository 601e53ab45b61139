"""Importing this module puts the TensorRT-LLM stand-in (tests/standin) first on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

STANDIN_PATH = str(Path(__file__).resolve().parent.parent / "standin")
if STANDIN_PATH not in sys.path:
    sys.path.insert(0, STANDIN_PATH)
