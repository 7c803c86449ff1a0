"""The Kubernetes examples in deploy/ name metrics the dispatcher exports, with label
values the example config has, and scale on the right semantics."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from broker_config.config import EXAMPLE_CONFIG, load_config
from dispatcher.observe.metrics import DispatcherMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def exported_metric_names() -> set[str]:
    config = load_config(EXAMPLE_CONFIG)
    registry = DispatcherMetrics(list(config.endpoints)).registry
    return {metric.name for metric in registry.collect()}


def test_the_keda_scaledobject_queries_the_desired_replicas_gauge_of_a_real_endpoint() -> None:
    scaled = yaml.safe_load((DEPLOY / "keda-scaledobject.yaml").read_text())
    assert scaled["kind"] == "ScaledObject"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    query = trigger["metadata"]["query"]
    match = re.fullmatch(r'max\((fairq_\w+)\{endpoint="(\w+)"\}\)', query)
    assert match is not None, query
    assert match.group(1) in exported_metric_names()
    assert match.group(2) in load_config(EXAMPLE_CONFIG).endpoints
    # Desired replicas as an average of 1 per replica: KEDA runs exactly that many.
    assert trigger["metadata"]["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "1"


def test_the_hpa_scales_on_the_same_gauge() -> None:
    hpa = yaml.safe_load((DEPLOY / "hpa.yaml").read_text())
    assert hpa["kind"] == "HorizontalPodAutoscaler"
    (metric,) = hpa["spec"]["metrics"]
    external = metric["external"]
    assert external["metric"]["name"] in exported_metric_names()
    assert (
        external["metric"]["selector"]["matchLabels"]["endpoint"]
        in load_config(EXAMPLE_CONFIG).endpoints
    )
    assert external["target"] == {"type": "AverageValue", "averageValue": "1"}
