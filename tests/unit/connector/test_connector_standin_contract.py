"""The TensorRT-LLM stand-in and the shipped connector against TensorRT-LLM's connector API, per
supported version (``tests/standin/upstream_api.py``, read from upstream)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from pathlib import Path

import pytest

from kvoffload import contract
from tests.standin.upstream_api import LAYOUT_API, UPSTREAM_API

pytestmark = pytest.mark.connector
STANDIN = str(Path(__file__).resolve().parents[2] / "standin")
if STANDIN not in sys.path:
    sys.path.insert(0, STANDIN)
CLASSES = ("KvCacheConnectorWorker", "KvCacheConnectorScheduler")
MAIN = UPSTREAM_API["main"]


def _params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def test_both_module_paths_serve_the_same_classes() -> None:
    new = importlib.import_module(UPSTREAM_API["main"]["module"])
    old = importlib.import_module(UPSTREAM_API["1.2"]["module"])
    for name in CLASSES:
        assert getattr(new, name) is getattr(old, name)


def test_standin_data_classes_are_mains() -> None:
    module = importlib.import_module(MAIN["module"])
    for name in ("RequestData", "SchedulerOutput", "PrefixLoad"):
        assert [f.name for f in dataclasses.fields(getattr(module, name))] == MAIN[name], name


def test_standin_layout_classes_are_mains() -> None:
    module = importlib.import_module(LAYOUT_API["module"])
    for name, fields in LAYOUT_API.items():
        if name.startswith("Kv"):
            assert [f.name for f in dataclasses.fields(getattr(module, name))] == fields, name
    for name in LAYOUT_API["functions"]:
        assert callable(getattr(module, name)), name


def test_standin_layout_addresses_pages_as_upstream_does() -> None:
    """A V2 layout over a pool: one region per page slot; ``BAD_PAGE_INDEX`` entries are dropped by
    ``valid_page_slots`` and refused by ``slot_tensor``, while the strided view reads row -1 as the
    last page (someone else's); the single-pool view is the pool's own memory."""
    import torch

    layout_module = importlib.import_module(LAYOUT_API["module"])
    pool = torch.arange(4 * 2 * 2 * 8, dtype=torch.float16).view(4, 2, 2, 8)
    layout = layout_module.describe_pool(pool, 4)
    (group,) = layout.groups
    (region,) = group.regions
    assert [(b.layer_id, b.role) for b in region.buffers] == [(0, "key"), (0, "value"), (1, "key"), (1, "value")]
    assert list(layout_module.valid_page_slots([3, -1, 0])) == [(0, 3), (2, 0)]
    with pytest.raises(IndexError):
        region.slot_tensor(-1)
    assert torch.equal(region.as_tensor(torch.float16)[-1], pool[3].flatten())
    single = layout.as_single_pool_tensor()
    single[1, 1, 0, 0] = -1.0
    assert pool[1, 1, 0, 0].item() == -1.0
    mla = layout_module.describe_pool(torch.zeros(4, 3, 1, 8, dtype=torch.float16), 4)
    assert mla.as_single_pool_tensor().shape == (4, 3, 1, 8)
    assert {b.role for b in mla.groups[0].regions[0].buffers} == {"key"}


def test_standin_methods_signatures_abstractness_and_attention_dp_flag_are_mains() -> None:
    module = importlib.import_module(MAIN["module"])
    for cls_name in CLASSES:
        cls = getattr(module, cls_name)
        assert _params(cls.__init__) == ["self", "llm_args"]
        assert cls.supports_attention_dp is False  # opt-in, as upstream
        for meth, (params, abstract) in MAIN[cls_name].items():
            assert _params(getattr(cls, meth)) == params, f"{cls_name}.{meth}"
            assert (meth in cls.__abstractmethods__) == abstract, f"{cls_name}.{meth}"


def test_standin_lets_a_grouped_form_implement_its_flat_form_as_upstream_does() -> None:
    module = importlib.import_module(MAIN["module"])

    class GroupedOnly(module.KvCacheConnectorScheduler):
        def build_connector_meta(self, scheduler_output):  # type: ignore[no-untyped-def]
            return None

        def get_num_new_matched_tokens(self, request, num_computed_tokens):  # type: ignore[no-untyped-def]
            return 0, False

        def request_finished_by_layer_group(self, request, cache_block_ids_by_layer_group):  # type: ignore[no-untyped-def]
            return False

        def update_state_after_alloc_by_layer_group(self, request, block_ids_by_layer_group):  # type: ignore[no-untyped-def]
            return None

    scheduler = GroupedOnly(None)  # instantiable: the flat forms are no longer abstract
    with pytest.raises(NotImplementedError, match="request_finished_by_layer_group, not request_finished"):
        scheduler.request_finished(None, [])


@pytest.mark.parametrize("version", sorted(UPSTREAM_API))
def test_shipped_connector_implements_every_abstract_hook_of_each_version(version: str) -> None:
    api = UPSTREAM_API[version]
    module = importlib.import_module(contract.CONNECTOR_MODULE)
    base = importlib.import_module(MAIN["module"])
    for cls_name, shipped_name in zip(
        CLASSES, (contract.CONNECTOR_WORKER_CLASS, contract.CONNECTOR_SCHEDULER_CLASS), strict=True
    ):
        cls = getattr(module, shipped_name)
        assert issubclass(cls, getattr(base, cls_name))
        assert not cls.__abstractmethods__, f"{shipped_name} leaves {cls.__abstractmethods__} abstract"
        for meth, (params, abstract) in api[cls_name].items():
            if abstract:
                assert getattr(cls, meth) is not getattr(getattr(base, cls_name), meth), f"{shipped_name}.{meth}"
            assert _params(getattr(cls, meth)) == params, f"{shipped_name}.{meth} on {version}"


def test_shipped_connector_declares_attention_dp_on_both_classes() -> None:
    module = importlib.import_module(contract.CONNECTOR_MODULE)
    base = importlib.import_module(MAIN["module"])
    base.validate_attention_dp(
        getattr(module, contract.CONNECTOR_WORKER_CLASS), getattr(module, contract.CONNECTOR_SCHEDULER_CLASS)
    )


def test_connector_never_imports_kubernetes_or_kopf() -> None:
    root = Path(__file__).resolve().parents[3] / "connector" / "src" / "kvoffload" / "connector"
    for path in root.rglob("*.py"):
        text = path.read_text()
        for banned in ("import kopf", "import kubernetes", "from kopf", "from kubernetes"):
            assert banned not in text, f"{path} uses {banned}"
