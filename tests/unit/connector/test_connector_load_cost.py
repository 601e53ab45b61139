"""The cost guard's pure parts: fitted load and prefill costs, the decision, the settings, and what a
computed hit frees and counts (``load_cost``, ``planning``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload import contract
from kvoffload.connector import planning
from kvoffload.connector.load_cost import MIN_PREFILL_SAMPLE_TOKENS, LinearCost, LoadCosts, fit, load_pays
from kvoffload.connector.settings import SettingsError, parse_settings

pytestmark = pytest.mark.connector
STANDIN = str(Path(__file__).resolve().parents[2] / "standin")
if STANDIN not in sys.path:
    sys.path.insert(0, STANDIN)


def _args() -> Any:
    from tensorrt_llm.llmapi.llm_args import KvCacheConfig, KvCacheConnectorConfig, TorchLlmArgs

    return TorchLlmArgs(model="m", kv_cache_config=KvCacheConfig(tokens_per_block=32),
                        kv_connector_config=KvCacheConnectorConfig(server_url=None))  # fmt: skip


@given(
    fixed=st.floats(0.0, 0.01),
    rate=st.floats(1e3, 1e7),
    sizes=st.lists(st.integers(1, 65536), min_size=2, max_size=32, unique=True),
)
def test_a_fit_recovers_the_fixed_cost_and_the_rate_of_exact_samples(
    fixed: float, rate: float, sizes: list[int]
) -> None:
    line = fit([(n, fixed + n / rate) for n in sizes])
    assert line is not None
    assert line.tokens_per_s == pytest.approx(rate, rel=1e-6)
    assert line.fixed_s == pytest.approx(fixed, rel=1e-6, abs=1e-9)


def test_samples_of_one_size_or_no_cost_line_fit_through_the_origin_and_none_without_samples() -> None:
    assert fit([]) is None
    assert fit([(1000, 0.01), (1000, 0.03)]) == LinearCost(0.0, 2000 / 0.04)
    assert fit([(100, 0.02), (1000, 0.01)]) == LinearCost(0.0, 1100 / 0.03)  # larger was faster: no line
    assert fit([(0, 0.5), (-3, 1.0)]) is None


def test_securing_then_copying_add_their_fixed_costs_and_their_times_per_token() -> None:
    both = LinearCost(0.001, 1000.0) + LinearCost(0.002, 1000.0)
    assert both.seconds(1000) == pytest.approx(0.003 + 2.0)


def test_a_load_pays_unless_both_costs_are_known_and_loading_is_slower() -> None:
    load = LinearCost(0.002, 100_000.0)  # 256 tokens: 4.56 ms
    assert load_pays(256, None, 1.0) and load_pays(256, load, None)
    assert load_pays(256, load, 50_000.0)  # prefill 5.12 ms
    assert not load_pays(256, load, 60_000.0)  # prefill 4.27 ms
    assert load_pays(65536, load, 60_000.0)  # the fixed cost is repaid by a long hit


def test_the_engine_process_measures_nothing_until_loads_and_prefills_were_timed() -> None:
    costs = LoadCosts()
    assert costs.load_cost() is None and costs.recompute_tokens_per_s() is None and costs.load_pays(256)
    costs.secured(1024, 0.001)
    assert costs.load_cost() is None, "a load is its securing and its copy"
    costs.copied(1024, 0.002)
    assert costs.load_cost() == LinearCost(0.0, 1024 / 0.001) + LinearCost(0.0, 1024 / 0.002)
    costs.computed(MIN_PREFILL_SAMPLE_TOKENS - 1, 1e-6)  # mostly decode: not a prefill sample
    assert costs.recompute_tokens_per_s() is None and costs.load_pays(1024)
    costs.computed(1024, 0.005)  # the first prefill, on a cold device: not a sample
    assert costs.recompute_tokens_per_s() is None
    costs.computed(1024, 0.001)
    assert costs.recompute_tokens_per_s() == 1024 / 0.001
    assert not costs.load_pays(1024), "3 ms to load what a 1 ms prefill computes"
    assert costs.load_pays(1024, given_recompute_tokens_per_s=100.0), "the operator's rate wins"


def test_a_hit_computed_instead_frees_every_chunk_the_lookup_locked() -> None:
    decision = planning.decide_load(1000, 300, 1024, 32, 256)  # the device holds the first chunk
    assert decision.loads and decision.free_ranges
    assert planning.compute_instead(decision) == planning.LoadDecision(0, 0, 0, 0, ((0, 768),))


def test_a_hit_computed_by_the_guard_is_counted_slower_to_load() -> None:
    reasons = planning.computed_reasons(1000, 0, 768, 32, 256, declined_as="slower_to_load")
    assert reasons[0] == (0, 768, "slower_to_load")
    assert "slower_to_load" in contract.COMPUTED_REASONS


def test_the_guard_is_on_by_default_and_a_given_prefill_rate_must_be_a_positive_number() -> None:
    settings = parse_settings({}, _args())
    assert settings.load_cost_guard and settings.recompute_tokens_per_s is None
    off = parse_settings({contract.ENV_LOAD_COST_GUARD: "off", contract.ENV_RECOMPUTE_TOKENS_PER_S: "25e3"}, _args())
    assert not off.load_cost_guard and off.recompute_tokens_per_s == 25e3
    for bad in ("0", "-5", "fast", "nan", "inf"):
        with pytest.raises(SettingsError, match=f"KVOFFLOAD_RECOMPUTE_TOKENS_PER_S='{bad}' is not a rate"):
            parse_settings({contract.ENV_RECOMPUTE_TOKENS_PER_S: bad}, _args())
