"""Every repository file the docs cite exists: README.md and docs/*.md name files as paths
(``operator/src/...``, ``docs/results/...``, ``benchmarks/x.py``, relative links) and as backticked
module file names (``webhook.py``); a rename that leaves a page behind fails here, not in a reader's
hands. docs/results/** are records of runs and are not scanned."""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
COMPONENTS = ("operator", "sidecar", "connector")
TOP_FOLDERS = ("operator", "sidecar", "connector", "common", "docs", "benchmarks", "hack", "tests", "charts")

KNOWN_STALE: dict[str, dict[str, str]] = {}
"""Pages' citations of files that are gone or renamed, with what to cite instead: ``{page: {cited:
instead}}``. Delete an entry when its page stops citing it (the test then says so)."""

THIRD_PARTY_FILES = {
    "engine_context.py": "LMCache's engine-driven transfer context",
    "nb_nl_two_nh_bs_hs.py": "LMCache's GPU connector for TensorRT-LLM's layout",
    "kv_cache_manager_v2.py": "TensorRT-LLM's KVCacheManagerV2",
}
"""Files of other projects that a page names alone; a name pinned to a commit (``x.py @1a2b3c4``) needs no entry."""

# A path: a top-level folder, then path characters; braces ({json,log}) and globs (*) allowed.
_PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP_FOLDERS) + r")/[\w./{},*-]*[\w*}/])")
# A module file named alone, in backticks: `webhook.py` (not `x/y.py`, which _PATH reads when it is ours).
_MODULE_FILE = re.compile(r"`([A-Za-z_][\w]*\.py)`")
# A relative Markdown link target: [text](results/README.md), ![plot](../benchmarks/results/x.png).
_LINK = re.compile(r"\]\(((?!https?:|mailto:|#)[^)\s]+)\)")
_PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|\bNN\b")
_CUT_AT_PLACEHOLDER = re.compile(r"[\w./-]*<")
_PINNED = re.compile(r"`?\s*@[0-9a-f]{6,40}\b")
"""What follows a file of another repository cited at a commit: ``_util.py`` @00043967."""


def _found(pattern: re.Pattern[str], text: str) -> list[str]:
    """``pattern``'s first group wherever it is not a placeholder's start nor pinned to a commit."""
    return [
        m[1]
        for m in pattern.finditer(text)
        if not _CUT_AT_PLACEHOLDER.match(text, m.end()) and not _PINNED.match(text, m.end())
    ]


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return [line for line in out.splitlines() if (ROOT / line).exists()]


TRACKED = _tracked()
TRACKED_SET = set(TRACKED)
BASENAMES = {PurePosixPath(p).name for p in TRACKED}
FOLDERS = {str(parent) for p in TRACKED for parent in PurePosixPath(p).parents if str(parent) != "."}


def _expand(path: str) -> list[str]:
    """``a.{json,log}`` -> ``a.json``, ``a.log`` (one brace group at a time)."""
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [x for alt in match[1].split(",") for x in _expand(path[: match.start()] + alt + path[match.end() :])]


def _exists(path: str) -> bool:
    """Tracked here: a file or folder, a glob matching one, a bare file name of one, or a component's
    package path written short (``connector/keys.py`` for ``connector/src/kvoffload/connector/keys.py``)."""
    path = path.rstrip("/")
    top, _, rest = path.partition("/")
    short = {"common": f"common/src/kvoffload/{rest}", **{c: f"{c}/src/kvoffload/{c}/{rest}" for c in COMPONENTS}}
    if top in short and rest and not rest.startswith(("src/", "pyproject")) and _exists(short[top]):
        return True
    if any(ch in path for ch in "*?["):
        return any(fnmatch.fnmatchcase(p, path) or fnmatch.fnmatchcase(p, path + "/*") for p in TRACKED)
    return path in FOLDERS or path in TRACKED_SET or ("/" not in path and path in BASENAMES)


def cited_paths(text: str, doc: PurePosixPath) -> set[str]:
    """Repository paths ``text`` (the page at ``doc``) cites: paths from the top, relative links, and
    backticked module file names (a bare name stands for any tracked file of that name)."""
    cited: set[str] = set()
    for raw in _found(_PATH, text):
        if not _PLACEHOLDER.search(raw):
            cited.update(_expand(raw.rstrip(".,;:")))
    for target in _LINK.findall(text):
        target = target.split("#")[0]
        if target and not _PLACEHOLDER.search(target):
            resolved = PurePosixPath(*(doc.parent / target).parts)
            parts: list[str] = []
            for part in resolved.parts:
                if part == "..":
                    parts.pop()
                else:
                    parts.append(part)
            cited.add("/".join(parts))
    cited.update(name for name in _found(_MODULE_FILE, text) if name not in THIRD_PARTY_FILES)
    return cited


def test_the_scanner_reads_paths_links_and_module_names_but_not_bare_words() -> None:
    text = (
        "See `operator/src/kvoffload/operator/plan/render.py`, docs/results/gpu-transfer/a.{json,log}, "
        "[history](results/history.md), ![p](../benchmarks/results/x.png), `webhook.py`, the options "
        "file `extra-llm-api-options.yaml`, `policy.json`, LMCache's v1/multiprocess/server.py, "
        "benchmarks/results/cpu-<UTC time>.json, `fleet-1000-...-8190a7a.json`, sidecar mode, operator/, "
        "TensorRT-LLM's `_util.py` @00043967, docs/source/features/kv-cache-connector.md @0f57080, `engine_context.py`."
    )
    assert cited_paths(text, PurePosixPath("docs/x.md")) == {
        "operator/src/kvoffload/operator/plan/render.py",
        "docs/results/gpu-transfer/a.json",
        "docs/results/gpu-transfer/a.log",
        "docs/results/history.md",
        "benchmarks/results/x.png",
        "webhook.py",
    }


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_doc_cites_exists(doc: Path) -> None:
    name = str(doc.relative_to(ROOT))
    known = KNOWN_STALE.get(name, {})
    cited = cited_paths(doc.read_text(), PurePosixPath(name))
    missing = sorted(p for p in cited if not _exists(p))
    assert [p for p in missing if p not in known] == [], f"{name} cites files that do not exist"
    assert sorted(set(known) - set(missing)) == [], f"{name} no longer cites these: delete them from KNOWN_STALE"
