"""Walk one call of a function through the package's files, as it runs, and count the stays.

    python -m hack.code_walk NODE ENTRY [--call N] [--package kvoffload] [--rooms]

NODE is a pytest node id that drives the code (a project test); ENTRY is `module:qualname` of the
function whose call is walked (the first call, or the Nth with --call). While that call runs, the
innermost frame that belongs to the package decides the room, a room being a source file: each
change of room starts a stay. A property's getter is read as an attribute where it is used, so its
frame is transparent, as code outside the package is. A walk that keeps to its rooms reads in one
pass; each return to a room already left is a place where a reader goes back. The counts printed are

    stays  rooms  returns (stays - rooms)  calls (package functions entered)

and with --rooms the stays in order, each with the functions entered during it.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest


@dataclass
class Stay:
    room: str
    functions: list[str] = field(default_factory=list)


@dataclass
class Walk:
    stays: list[Stay] = field(default_factory=list)
    calls: int = 0

    @property
    def rooms(self) -> int:
        return len({s.room for s in self.stays})

    @property
    def returns(self) -> int:
        return len(self.stays) - self.rooms

    def summary(self) -> str:
        return f"{len(self.stays)} stays, {self.rooms} rooms, {self.returns} returns, {self.calls} calls"


def package_roots(package: str) -> list[Path]:
    """The folders a (namespace) package spans: every distribution's src/<package>."""
    module = importlib.import_module(package)
    return [Path(p).resolve() for p in module.__path__]


def room_of(filename: str, roots: list[Path]) -> str | None:
    """The file's path under one of the package's roots, or None for code outside the package."""
    path = Path(filename)
    if not path.is_absolute():
        return None
    for root in roots:
        try:
            return str(path.resolve().relative_to(root.parent))
        except ValueError:
            continue
    return None


def is_property_getter(frame: FrameType) -> bool:
    """Whether the frame runs the getter of a property (or cached property) of a module-level class."""
    owner_name, _, attr = getattr(frame.f_code, "co_qualname", "").rpartition(".")
    if not owner_name or "<locals>" in owner_name:
        return False
    owner: Any = sys.modules.get(frame.f_globals.get("__name__", ""))
    for part in owner_name.split("."):
        owner = getattr(owner, part, None)
    if not isinstance(owner, type):
        return False
    found = inspect.getattr_static(owner, attr, None)
    return isinstance(found, (property, functools.cached_property))


class Walker:
    """A profile hook recording the rooms of one call of `entry` (its Nth call)."""

    def __init__(self, entry: Callable[..., Any], roots: list[Path], call: int = 1) -> None:
        code = getattr(entry, "__code__", None)
        if code is None:
            raise SystemExit(f"code_walk: {entry!r} is not a Python function")
        self._entry_code = code
        self._roots = roots
        self._wanted_call = call
        self._entry_calls = 0
        self._depth = 0  # frames of the walked call on the stack, itself included
        self._stack: list[str | None] = []
        self._rooms: dict[str, str | None] = {}
        self._getters: dict[CodeType, bool] = {}
        self.walk = Walk()

    def _room(self, frame: FrameType) -> str | None:
        code = frame.f_code
        if code not in self._getters:
            self._getters[code] = is_property_getter(frame)
        if self._getters[code]:
            return None
        filename = code.co_filename
        if filename not in self._rooms:
            self._rooms[filename] = room_of(filename, self._roots)
        return self._rooms[filename]

    def _enter(self, room: str, function: str) -> None:
        stays = self.walk.stays
        if not stays or stays[-1].room != room:
            stays.append(Stay(room))
        if function:
            stays[-1].functions.append(function)

    def _innermost(self) -> str | None:
        return next((r for r in reversed(self._stack) if r is not None), None)

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        if self._depth == 0:
            if event == "call" and frame.f_code is self._entry_code:
                self._entry_calls += 1
                if self._entry_calls != self._wanted_call:
                    return
            else:
                return
        if event == "call":
            self._depth += 1
            room = self._room(frame)
            self._stack.append(room)
            if room is not None:
                self.walk.calls += 1
                self._enter(room, getattr(frame.f_code, "co_qualname", frame.f_code.co_name))
            return
        self._depth -= 1
        self._stack.pop()
        back = self._innermost()
        if back is not None and self._depth > 0:
            self._enter(back, "")


def resolve_entry(spec: str) -> Callable[..., Any]:
    """`package.module:Class.method` → the function object (a method's underlying function)."""
    module_name, sep, qualname = spec.partition(":")
    if not sep or not qualname:
        raise SystemExit(f"code_walk: ENTRY must be module:qualname, got {spec!r}")
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise SystemExit(f"code_walk: {module_name} has no {qualname!r}")
    return getattr(target, "__func__", target)


@contextmanager
def profiling(hook: Callable[[FrameType, str, Any], None]) -> Iterator[None]:
    """The hook on this thread only: the walked call is one thread's story."""
    previous = sys.getprofile()
    sys.setprofile(hook)  # type: ignore[arg-type]
    try:
        yield
    finally:
        sys.setprofile(previous)


class _WalkPlugin:
    """Installs the walker around each test's call, once pytest has put the test's paths in place
    (the stand-in for TensorRT-LLM is on the path only then)."""

    def __init__(self, entry: str, call: int, package: str) -> None:
        self._entry, self._call, self._package = entry, call, package
        self.walker: Walker | None = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: Any) -> Iterator[None]:
        if self.walker is None:
            self.walker = Walker(resolve_entry(self._entry), package_roots(self._package), self._call)
        with profiling(self.walker.hook):
            yield


def walk_test(node: str, entry: str, *, call: int = 1, package: str = "kvoffload") -> Walk:
    """Run the pytest node with the walker installed; the walk of the entry's call."""
    plugin = _WalkPlugin(entry, call, package)
    code = pytest.main(["-q", "-p", "no:randomly", "-p", "no:cacheprovider", node], plugins=[plugin])
    if code != 0:
        raise SystemExit(f"code_walk: the test {node} failed (pytest exit {int(code)}); its walk is not told")
    if plugin.walker is None or not plugin.walker.walk.stays:
        raise SystemExit(f"code_walk: the test {node} never called {entry} {call} time(s)")
    return plugin.walker.walk


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hack.code_walk", description=__doc__.splitlines()[0])
    parser.add_argument("node", help="pytest node id of the test that drives the code")
    parser.add_argument("entry", help="module:qualname of the function whose call is walked")
    parser.add_argument("--call", type=int, default=1, help="walk the Nth call of the entry (default 1)")
    parser.add_argument("--package", default="kvoffload", help="the package whose files are rooms")
    parser.add_argument("--rooms", action="store_true", help="print the stays in order")
    args = parser.parse_args(argv)
    walk = walk_test(args.node, args.entry, call=args.call, package=args.package)
    if args.rooms:
        seen: set[str] = set()
        for n, stay in enumerate(walk.stays, 1):
            mark = "back" if stay.room in seen else "new "
            seen.add(stay.room)
            names = ", ".join(dict.fromkeys(stay.functions))
            print(f"{n:3d}. {mark} {stay.room}" + (f"  ({names})" if names else ""))
    print(f"walk of {args.entry}: {walk.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
