"""hack.code_walk: the stays, rooms and returns of one call, counted from what runs."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from hack.code_walk import Walker, package_roots, profiling, resolve_entry


@pytest.fixture
def walkpkg(tmp_path: Path) -> Iterator[str]:
    """A package of three files: front.serve calls into plan twice and render once, which calls plan."""
    pkg = tmp_path / "walkpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "plan.py").write_text("def plan(x):\n    return x + 1\n")
    (pkg / "render.py").write_text("from walkpkg.plan import plan\n\ndef render(x):\n    return str(plan(x))\n")
    (pkg / "front.py").write_text(
        textwrap.dedent("""
        from walkpkg.plan import plan
        from walkpkg.render import render

        def serve(x):
            a = plan(x)
            b = plan(a)
            return render(b)
        """)
    )
    sys.path.insert(0, str(tmp_path))
    try:
        yield "walkpkg"
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "walkpkg" or m.startswith("walkpkg.")]:
            del sys.modules[name]


def walk_of(entry: str, package: str, *calls: int, call: int = 1) -> Walker:
    walker = Walker(resolve_entry(entry), package_roots(package), call)
    serve = importlib.import_module("walkpkg.front").serve
    with profiling(walker.hook):
        for x in calls:
            serve(x)
    return walker


def test_each_change_of_file_is_a_stay_and_each_stay_in_a_file_seen_before_a_return(walkpkg: str) -> None:
    walk = walk_of("walkpkg.front:serve", walkpkg, 1).walk
    rooms = [s.room for s in walk.stays]
    assert rooms == [
        "walkpkg/front.py", "walkpkg/plan.py", "walkpkg/front.py", "walkpkg/plan.py", "walkpkg/front.py",
        "walkpkg/render.py", "walkpkg/plan.py", "walkpkg/render.py", "walkpkg/front.py",
    ]  # fmt: skip
    assert (len(walk.stays), walk.rooms, walk.returns, walk.calls) == (9, 3, 6, 5)


def test_only_the_chosen_call_of_the_entry_is_walked(walkpkg: str) -> None:
    first = walk_of("walkpkg.front:serve", walkpkg, 1, 2).walk
    second = walk_of("walkpkg.front:serve", walkpkg, 1, 2, call=2).walk
    assert first.summary() == second.summary()
    assert not walk_of("walkpkg.front:serve", walkpkg, 1, call=2).walk.stays


def test_a_bad_entry_is_named_in_a_one_line_exit(walkpkg: str) -> None:
    with pytest.raises(SystemExit, match=r"walkpkg\.front has no 'nothing'"):
        resolve_entry("walkpkg.front:nothing")
    with pytest.raises(SystemExit, match="module:qualname"):
        resolve_entry("walkpkg.front")


def test_a_property_read_in_another_file_is_not_a_stay(tmp_path: Path) -> None:
    pkg = tmp_path / "proppkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "shape.py").write_text("class Shape:\n    @property\n    def size(self):\n        return 3\n")
    (pkg / "use.py").write_text("from proppkg.shape import Shape\n\ndef use():\n    return Shape().size\n")
    sys.path.insert(0, str(tmp_path))
    try:
        walker = Walker(resolve_entry("proppkg.use:use"), package_roots("proppkg"))
        use = importlib.import_module("proppkg.use").use
        with profiling(walker.hook):
            use()
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("proppkg")]:
            del sys.modules[name]
    assert [s.room for s in walker.walk.stays] == ["proppkg/use.py"]
