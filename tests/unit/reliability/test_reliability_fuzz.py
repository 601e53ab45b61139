"""Property tests (hypothesis) over every parser of untrusted input and the fragment renderer.

Inputs a user controls: workload annotations, KVCachePolicy specs, the workload's own pod
template, and (in the sidecar) env vars and the policy file. Whatever they hold, parsing returns
validated settings or a precise error value/exception, and the renderer returns bodies or an error:
never a crash. Rendered bodies are JSON-serialisable and keep the invariants the apiserver needs
(DNS-1123 names, string env values, no duplicate list keys). A sample of rendered fragments is
also sent to the real apiserver with a server-side dry-run in tests/reliability/test_reliability_fuzz_dryrun.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from kvoffload import contract as c
from kvoffload.operator.intent.settings import (
    InjectionSettings,
    enabled_state,
    resolve_settings,
)
from kvoffload.operator.intent.workload import read_workload
from kvoffload.operator.plan.fragment import ClusterInfo, RenderedInjection, render_injection_fragment, render_removal
from kvoffload.policy_values import PolicyError
from kvoffload.sidecar import settings as sidecar_settings
from tests.support.fuzz_strategies import (
    ANNOTATIONS,
    DEFAULTS,
    DNS_LABEL,
    FUZZ,
    JSONISH,
    POLICY_SPEC,
    RENDER_ANNOTATIONS,
    SIDECAR_ENV_KEYS,
    SIDECAR_VALUES,
    TEXT,
    VALID_SPEC,
    check_rendered,
    policy_object,
    workloads,
)

pytestmark = pytest.mark.reliability


@FUZZ
@given(annotations=ANNOTATIONS)
def test_fuzz_annotation_parser_never_crashes(annotations: dict[str, str]) -> None:
    annotations = {**annotations, c.ANN_ENABLED: annotations.get(c.ANN_ENABLED, "true")}
    assert isinstance(enabled_state(annotations), (bool, PolicyError))
    result = resolve_settings(annotations, policy_object({}), DEFAULTS, "ns")
    assert isinstance(result, (InjectionSettings, PolicyError))
    if isinstance(result, PolicyError):
        assert result.field and result.message.startswith(result.field)
    else:
        assert result.l1_bytes > 0 and result.shm_bytes > 0 and result.mode in ("sidecar", "node")
        assert result.container is None or DNS_LABEL.match(result.container)


@FUZZ
@given(spec=st.one_of(POLICY_SPEC, JSONISH))
def test_fuzz_policy_parser_never_crashes(spec: Any) -> None:
    annotations = {c.ANN_ENABLED: "true", c.ANN_POLICY: "p"}
    result = resolve_settings(annotations, policy_object(spec), DEFAULTS, "ns")
    assert isinstance(result, (InjectionSettings, PolicyError))
    event("accepted" if isinstance(result, InjectionSettings) else "refused")
    if isinstance(result, PolicyError):
        assert result.field and result.allowed
    else:
        assert 16 <= result.chunk_size <= 65536 and result.chunk_size % 16 == 0
        assert 1 <= result.max_workers <= 64
        json.dumps(result.policy_document())  # what the sidecar reads must serialise


@FUZZ
@given(workload=workloads(), spec=st.one_of(VALID_SPEC, VALID_SPEC, POLICY_SPEC), annotations=RENDER_ANNOTATIONS)
def test_fuzz_fragment_renderer_never_crashes(workload: dict[str, Any], spec: Any, annotations: Mapping[str, str]
                                              ) -> None:  # fmt: skip
    annotations = {**annotations, c.ANN_ENABLED: "true", c.ANN_POLICY: "p"}
    workload["metadata"]["annotations"] = annotations
    resolved = resolve_settings(annotations, policy_object(spec), DEFAULTS, "ns")
    if isinstance(resolved, PolicyError):
        return
    for native in (True, False):
        rendered = render_injection_fragment(workload, resolved, ClusterInfo(native_sidecars=native))
        assert isinstance(rendered, (RenderedInjection, PolicyError))
        event("rendered" if isinstance(rendered, RenderedInjection) else f"refused: {rendered.reason}")
        if isinstance(rendered, RenderedInjection):
            check_rendered(rendered)
            again = render_injection_fragment(workload, resolved, ClusterInfo(native_sidecars=native))
            assert isinstance(again, RenderedInjection) and again.workload_apply == rendered.workload_apply
    assert not render_removal(read_workload(workload)).steps  # nothing of ours in a never-injected object


@FUZZ
@given(env=st.dictionaries(SIDECAR_ENV_KEYS, SIDECAR_VALUES, max_size=8), spec=st.one_of(st.none(), POLICY_SPEC, JSONISH),
       policy_text=st.one_of(TEXT, JSONISH.map(json.dumps)))  # fmt: skip
def test_fuzz_sidecar_settings_never_crash(env: dict[str, str], spec: Any, policy_text: str) -> None:
    try:
        loaded = sidecar_settings.load_settings(env, spec)
    except sidecar_settings.SettingsError as exc:
        assert str(exc) and ":" in str(exc)
    else:
        assert loaded.l1_size_bytes > 0 and 0 < loaded.request_port < 65536
        assert len({loaded.request_port, loaded.lmcache_http_port, loaded.sidecar_http_port}) == 3
    try:
        assert isinstance(sidecar_settings.parse_policy_text(policy_text, "/etc/p.json"), dict)
    except sidecar_settings.SettingsError as exc:
        assert "/etc/p.json" in str(exc)
