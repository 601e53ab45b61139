"""``promtool test rules`` for the chart's token-source rules, fed with prompt-token counters
(``{(source, reason): tokens}``, as a real Prometheus scraped them or made up)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from kvoffload import contract


def _series(labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"series": f"{contract.M_PROMPT_TOKENS}_total{{{inner}}}", "values": values}


def token_source_tests(split: dict[tuple[str, str], float], namespace: str, model: str) -> dict[str, Any]:
    """A promtool test file: each counter grows by its scraped total every minute for an hour, then
    (reuse collapsing at the same traffic) every reused token is computed instead for an hour.

    Checks the ratios the recording rules give at 30 min (the split itself) and that
    KvoffloadPromptReuseCollapsed fires after the collapse, and not before it.
    """
    total = sum(split.values())
    cache = sum(v for (s, _), v in split.items() if s == "cache")
    reused = sum(v for (s, _), v in split.items() if s in ("device", "cache"))
    base = {"namespace": namespace, "model": model, "backend": "sidecar"}
    input_series = []
    for (source, reason), value in sorted(split.items()):
        after = 0 if source in ("device", "cache") else value + (reused if reason == "not_cached" else 0)
        values = f"0+{value:g}x60 {60 * value + after:g}+{after:g}x59"
        input_series.append(_series({**base, "source": source, "reason": reason}, values))
    if not any(s == "computed" and r == "not_cached" for s, r in split):
        input_series.append(
            _series({**base, "source": "computed", "reason": "not_cached"}, f"0x60 {reused:g}+{reused:g}x59")
        )
    who = {"namespace": namespace, "model": model}
    return {
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": input_series,
                "promql_expr_test": [
                    # ratios to 1e-4 (promtool compares floats exactly; rate() rounds differently than division)
                    {
                        "expr": "round(10000 * kvoffload:prompt_tokens_from_cache:ratio_rate5m)",
                        "eval_time": "30m",
                        "exp_samples": [{"labels": _labels(who), "value": round(10000 * cache / total)}],
                    },
                    {
                        "expr": "round(10000 * kvoffload:prompt_tokens_reused:ratio_rate5m)",
                        "eval_time": "30m",
                        "exp_samples": [{"labels": _labels(who), "value": round(10000 * reused / total)}],
                    },
                ],
                "alert_rule_test": [
                    {"alertname": "KvoffloadPromptReuseCollapsed", "eval_time": "55m", "exp_alerts": []},
                    {
                        "alertname": "KvoffloadPromptReuseCollapsed",
                        "eval_time": "80m",
                        "exp_alerts": [
                            {
                                "exp_labels": {**who, "severity": "warning"},
                                "exp_annotations": {
                                    "summary": f"Prompt-token reuse collapsed for {model} in {namespace}",
                                    "description": "Reused share 0%, under half of an hour ago at the same traffic: "
                                    "see kvoffload:prompt_tokens:rate5m by reason.",
                                },
                            }
                        ],
                    },
                ],
            }
        ],
    }


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def run_token_source_tests(rules: dict[str, Any], split: dict[tuple[str, str], float], workdir: Path,
                           namespace: str = "ns", model: str = "model") -> subprocess.CompletedProcess[str]:  # fmt: skip
    """Write the chart's rule groups and the test file to ``workdir``; run ``promtool test rules``."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "rules.yaml").write_text(yaml.safe_dump(rules))
    test = token_source_tests(split, namespace, model)
    test["rule_files"] = ["rules.yaml"]
    (workdir / "tests.yaml").write_text(yaml.safe_dump(test))
    return subprocess.run(["promtool", "test", "rules", "tests.yaml"], cwd=workdir, capture_output=True, text=True)
