"""One naming rule for test files, so a test is found from what it tests: under
``tests/<kind>/<area>/`` a file is ``test_<area>_<subject>.py``; where a pure unit test and an
integration test share a subject the unit one adds ``_decisions``; no two test files share a name."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def all_test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "standin" not in p.parts)


def test_a_test_file_in_an_area_folder_names_its_area_first() -> None:
    misnamed = [
        str(p.relative_to(TESTS))
        for p in all_test_files()
        if p.parent.parent.name in ("unit", "integration") and not p.name.startswith(f"test_{p.parent.name}_")
    ]
    assert misnamed == []


def test_no_two_test_files_share_a_name() -> None:
    counts = Counter(p.name for p in all_test_files())
    assert sorted(name for name, n in counts.items() if n > 1) == []
