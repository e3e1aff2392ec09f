"""The series the dashboards add to the engine's: the plan's GPUs per phase (the goodput
per GPU denominator), the latency objectives (the SLO lines) and the attainment objective
(the error budget the burn-rate alerts measure)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from distserve_engine.metrics import ServingMetrics, shape_num_gpus


def samples(metrics: ServingMetrics, name: str) -> dict[tuple, float]:
    """(sorted label items) -> value of every sample named `name`."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_plan_gpus_per_phase_follow_the_plan_served_under():
    metrics = ServingMetrics("d", "router", "router", "m")
    metrics.set_plan("p1", prefill="tp2pp1x3", decode="tp1pp2x2", predicted_attainment=0.9)
    gpus = {dict(k)["phase"]: v for k, v in samples(metrics, "distserve_plan_gpus").items()}
    assert gpus == {"prefill": 6, "decode": 4}
    metrics.set_plan("p2", prefill="tp1pp1x1", decode="")  # a switch replaces the series
    found = samples(metrics, "distserve_plan_gpus")
    assert [(dict(k)["plan_id"], dict(k)["phase"], v) for k, v in found.items()] == [("p2", "prefill", 1)]
    metrics.set_plan(None)
    assert samples(metrics, "distserve_plan_gpus") == {}


@pytest.mark.parametrize(("shape", "num_gpus"), [
    ("tp1pp1x1", 1), ("tp8pp4x2", 64), ("tp2pp1x1+tp1pp2x1", 4), ("", None), ("tp2pp1", None),
    ("x3", None), ("tp1pp1x1+", None)])
def test_shape_num_gpus(shape, num_gpus):
    assert shape_num_gpus(shape) == num_gpus


def test_slo_targets_are_exported_and_replaced():
    metrics = ServingMetrics("d", "router", "router", "m")
    metrics.set_slo(2.0, 0.1)
    targets = {dict(k)["slo"]: v for k, v in samples(metrics, "distserve_slo_target_seconds").items()}
    assert targets == {"ttft": 2.0, "tpot": 0.1}
    metrics.set_slo(None, 0.2)
    targets = {dict(k)["slo"]: v for k, v in samples(metrics, "distserve_slo_target_seconds").items()}
    assert targets == {"tpot": 0.2}


def test_attainment_objective_is_exported_when_given_and_replaced():
    metrics = ServingMetrics("d", "router", "router", "m")
    metrics.set_slo(2.0, 0.1, attainment=0.99)
    assert list(samples(metrics, "distserve_slo_attainment_objective").values()) == [0.99]
    metrics.set_slo(2.0, 0.1)  # settings without one: the rules' default applies
    assert samples(metrics, "distserve_slo_attainment_objective") == {}


def test_a_process_exports_its_spec_s_attainment_objective():
    from distserve.local.settings import serve_settings
    from distserve.spec import load_manifest
    from distserve_engine.server.assembly import build_metrics

    spec = load_manifest("examples/local.yaml").spec
    spec = spec.model_copy(update={"slo": spec.slo.model_copy(update={"attainment": 0.99})})
    settings = serve_settings(spec, {"prefill": 1, "decode": 1}, "local", "/models/m")
    metrics = build_metrics(settings, "router", "router-0")
    assert list(samples(metrics, "distserve_slo_attainment_objective").values()) == [0.99]
