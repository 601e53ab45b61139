"""The TensorRT-LLM stand-in (and the shipped connector) against the reference API JSON."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import sys
from pathlib import Path

import pytest

from kvoffload import contract

pytestmark = pytest.mark.connector
REFERENCE = Path("/work/shared/reference/trtllm-connector-api.json")
STANDIN = str(Path(__file__).resolve().parents[2] / "standin")
if STANDIN not in sys.path:
    sys.path.insert(0, STANDIN)


@pytest.fixture(scope="module")
def api() -> dict:
    assert REFERENCE.is_file(), f"reference API description missing: {REFERENCE}"
    return json.loads(REFERENCE.read_text())


def test_both_module_paths_exist(api: dict) -> None:
    new = importlib.import_module(api["module"])
    old = importlib.import_module(api["older_module"])
    for name in api["classes"]:
        assert getattr(new, name) is getattr(old, name)


def test_dataclass_fields(api: dict) -> None:
    module = importlib.import_module(api["module"])
    for name, fields in api["dataclasses"].items():
        have = [f.name for f in dataclasses.fields(getattr(module, name))]
        assert have[: len(fields)] == fields, name
    request_fields = {f.name for f in dataclasses.fields(module.RequestData)}
    assert "cache_salt" in request_fields  # the newer optional field, so connectors are tested on both


def test_classes_methods_signatures_and_abstractness(api: dict) -> None:
    module = importlib.import_module(api["module"])
    for cls_name, spec in api["classes"].items():
        cls = getattr(module, cls_name)
        assert list(inspect.signature(cls.__init__).parameters) == spec["init"]
        for meth, mspec in spec["methods"].items():
            fn = getattr(cls, meth)
            assert list(inspect.signature(fn).parameters) == mspec["params"], f"{cls_name}.{meth}"
            is_abstract = meth in cls.__abstractmethods__
            assert is_abstract == mspec["abstract"], f"{cls_name}.{meth} abstract={is_abstract}"


def test_shipped_connector_implements_every_hook(api: dict) -> None:
    module = importlib.import_module(contract.CONNECTOR_MODULE)
    base = importlib.import_module(api["module"])
    pairs = {
        contract.CONNECTOR_SCHEDULER_CLASS: base.KvCacheConnectorScheduler,
        contract.CONNECTOR_WORKER_CLASS: base.KvCacheConnectorWorker,
    }
    for name, parent in pairs.items():
        cls = getattr(module, name)
        assert issubclass(cls, parent)
        assert not cls.__abstractmethods__, f"{name} leaves {cls.__abstractmethods__} abstract"
        for meth, mspec in api["classes"][parent.__name__]["methods"].items():
            assert list(inspect.signature(getattr(cls, meth)).parameters) == mspec["params"], f"{name}.{meth}"


def test_connector_never_imports_kubernetes_or_kopf() -> None:
    root = Path(__file__).resolve().parents[3] / "kvoffload" / "connector"
    for path in root.rglob("*.py"):
        text = path.read_text()
        for banned in ("import kopf", "import kubernetes", "from kopf", "from kubernetes"):
            assert banned not in text, f"{path} uses {banned}"
