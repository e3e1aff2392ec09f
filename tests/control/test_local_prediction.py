"""The simulator's prediction of a local run: the very requests sent, on the settings' instances."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from distserve.cli.fidelity import _sample_trace, compare_deployment
from distserve.cli.up import _predicted
from distserve.local.load import Outcome
from distserve.local.prediction import (
    DRIFT_DRAWS,
    LocalShape,
    engine_context,
    predict_draws,
    predict_run,
    requests_of,
)
from distserve.local.report import format_draws
from distserve.local.settings import instance_counts, instance_parallel, serve_settings
from distserve.plan import PhaseConfig, Plan, SegmentPlacement
from distserve.search import build_context
from distserve.search.trials import instance_model
from distserve.simulator import SpeedDrift
from distserve.spec import load_manifest
from distserve.workload import Request

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(("instances", "serving_mode"), [
    ({"prefill": 1, "decode": 1}, "disaggregated"), ({"colocated": 2}, "colocated"),
])
def test_each_request_alone_waits_only_for_its_own_prefill(instances, serving_mode):
    spec = load_manifest(EXAMPLES / "local.yaml").spec
    settings = serve_settings(spec, instances, "test", "/model")
    ctx = engine_context(build_context(spec), settings)
    requests = [Request(0, 0.0, 100, 5), Request(1, 100.0, 300, 8)]  # far apart: no queue
    summary = predict_run(ctx, LocalShape.from_settings(settings), requests, 0.02)
    timer = instance_model(ctx, serving_mode, (1, 1)).timer
    alone_s = [timer.prefill_iteration_s((n,)) for n in (100, 300)]
    assert (summary.num_requests, summary.num_errors, summary.attainment) == (2, 0, 1.0)
    assert summary.ttft_p_s[50] == pytest.approx(sum(alone_s) / 2)  # the median of two
    assert summary.rate_rps == 0.02


@pytest.mark.parametrize("instances", [{"prefill": 1, "decode": 1}, {"colocated": 2}])
def test_a_burst_past_the_routers_waiting_limit_is_predicted_refused_as_it_is_served(instances):
    spec = load_manifest(EXAMPLES / "local.yaml").spec
    settings = serve_settings(spec, instances, "test", "/model")
    ctx = engine_context(build_context(spec), settings)
    assert ctx.max_waiting_requests == settings.max_waiting_requests
    limit = settings.max_waiting_requests
    requests = [Request(i, i * 1e-4, 400, 4) for i in range(limit + 5)]  # faster than a prefill
    summary = predict_run(ctx, LocalShape.from_settings(settings), requests, 1e4)
    assert summary.num_errors == 5  # the 429s a client of the router gets
    assert summary.attainment <= limit / (limit + 5)



@pytest.mark.parametrize("instances", [{"prefill": 1, "decode": 1}, {"colocated": 2}])
def test_a_router_that_admits_by_ttft_is_predicted_to_refuse_the_burst_past_the_slo(instances):
    """spec.router.admitByTtft reaches the router's settings and the prediction: after 20
    lone requests a burst is served as far as its first tokens can come within the TTFT
    SLO and the rest refused, where the router that does not admit by TTFT serves every
    one of them, late, and the few requests just after the burst late too."""
    spec = load_manifest(EXAMPLES / "local.yaml").spec
    assert not serve_settings(spec, instances, "test", "/model").admit_by_ttft  # the default
    spec.router.admit_by_ttft = True
    settings = serve_settings(spec, instances, "test", "/model")
    ctx = engine_context(build_context(spec), settings)
    assert settings.admit_by_ttft and ctx.admit_by_ttft_s == spec.slo.ttft_seconds
    lone = [Request(i, 30.0 * i, 400, 4) for i in range(20)]
    burst = [Request(20 + i, 700.0 + i * 1e-3, 400, 4)
             for i in range(settings.max_waiting_requests - 1)]
    after = [Request(len(lone) + len(burst) + i, 730.0 + 30.0 * i, 400, 4) for i in range(3)]
    shape = LocalShape.from_settings(settings)
    admitting = predict_run(ctx, shape, lone + burst + after, 1.0)
    serving_all = predict_run(dataclasses.replace(ctx, admit_by_ttft=False), shape,
                              lone + burst + after, 1.0)
    assert serving_all.num_errors == 0 and serving_all.ttft_p_s[90] > spec.slo.ttft_seconds
    assert 0 < admitting.num_errors < len(burst)
    assert admitting.ttft_p_s[90] <= spec.slo.ttft_seconds  # those served, served in time
    # the refused would have missed it anyway, and the requests after the burst find
    # the queue drained: each of them meets the SLOs only where the burst was cut (on
    # colocated instances, some of the burst's decodes too, beside fewer prefills)
    n = admitting.num_requests
    assert round(admitting.attainment * n) >= round(serving_all.attainment * n) + len(after)

def make_mixed_plan() -> Plan:
    """prefill: one tp1 pp1 instance, then one tp1 pp2; decode: one tp1 pp1 (one node)."""
    segments = (SegmentPlacement("prefill", 0, 0, "node-0", (0,)),
                SegmentPlacement("prefill", 1, 0, "node-0", (1,)),
                SegmentPlacement("prefill", 1, 1, "node-0", (2,)),
                SegmentPlacement("decode", 0, 0, "node-0", (3,)))
    return Plan(algorithm="fixed", model="tiny", accelerator="CPU",
                prefill=PhaseConfig(1, 1, 1), decode=PhaseConfig(1, 1, 1), segments=segments,
                goodput_rps=1.0, attainment=0.9, latency=None, ttft_slo_s=6.0, tpot_slo_s=0.4,
                attainment_target=0.9, extra_prefill=(PhaseConfig(1, 2, 1),))


def burst() -> list[Request]:
    """Eight 400-token prompts at once: one prefill instance queues them, two share them."""
    return [Request(i, 0.0, 400, 4) for i in range(8)]


def test_a_mixed_plan_is_simulated_whole_each_instance_with_its_shape(capsys):
    spec = load_manifest(EXAMPLES / "local.yaml").spec
    plan = make_mixed_plan()
    settings = serve_settings(spec, instance_counts(spec, plan), "test", "/model",
                              instance_parallel(spec, plan), plan)
    shape = LocalShape.from_settings(settings)
    assert shape.describe() == "2 prefill (1 x tp1pp1 + 1 x tp1pp2) + 1 decode"
    mixed = _predicted(spec, settings, burst(), 8.0)
    assert "no simulated figures" not in capsys.readouterr().err
    assert (mixed.num_requests, mixed.num_errors) == (8, 0)
    first_group_only = serve_settings(spec, {"prefill": 1, "decode": 1}, "test", "/model")
    alone = _predicted(spec, first_group_only, burst(), 8.0)
    # the pp2 instance takes part of the burst: the queue ahead of the last prompt is shorter
    assert mixed.ttft_p_s[99] < alone.ttft_p_s[99]


def test_fidelity_compares_a_mixed_plan_with_its_simulated_figures(capsys):
    spec = load_manifest(EXAMPLES / "local.yaml").spec

    def answer_at_once(url, requests):
        return [Outcome(r.req_id, r.prompt_tokens, r.output_tokens, 1.0, 0.1, r.output_tokens)
                for r in requests]

    def launch(settings, port):
        return contextlib.nullcontext(SimpleNamespace(url=f"http://127.0.0.1:{port}"))

    rows = compare_deployment(spec, make_mixed_plan(), "local", "/model", 0,
                              _sample_trace(spec, 12), [0.1], 18000,
                              drive_fn=answer_at_once, launch=launch,
                              iterations_fn=lambda _: {})
    out = capsys.readouterr().out
    ((rate, _, predicted, _),) = rows
    assert rate == 0.1 and predicted.num_requests == 12
    assert "2 prefill (1 x tp1pp1 + 1 x tp1pp2) + 1 decode: simulated knee" in out
    assert "simulated" in next(line for line in out.splitlines() if "TTFT p50" in line)


def test_a_drifting_speed_is_predicted_as_the_median_of_its_histories():
    spec = load_manifest(EXAMPLES / "local.yaml").spec
    settings = serve_settings(spec, {"colocated": 2}, "test", "/model")
    steady = engine_context(build_context(spec), settings)
    ctx = dataclasses.replace(steady, drift=SpeedDrift(30.0, 0.1, 2.0, 0.1, 0.2))
    shape = LocalShape.from_settings(settings)
    requests = requests_of(_sample_trace(spec, 200).at_rate(1.0))
    draws = predict_draws(ctx, shape, requests, 1.0)
    assert len(draws) == DRIFT_DRAWS
    assert len({d.ttft_p_s[90] for d in draws}) == DRIFT_DRAWS  # each its own history
    median = predict_run(ctx, shape, requests, 1.0)
    assert median.ttft_p_s[90] == pytest.approx(np.median([d.ttft_p_s[90] for d in draws]))
    assert median.attainment == pytest.approx(np.median([d.attainment for d in draws]))
    # the same seeds, the same prediction; no drift, one draw
    assert predict_run(ctx, shape, requests, 1.0) == median
    assert len(predict_draws(steady, shape, requests, 1.0)) == 1
    # what fidelity prints beside the measured figures: each one's range over the draws
    measured = dataclasses.replace(median, attainment=1.5)
    text = format_draws(draws, measured)
    assert f"over {DRIFT_DRAWS} histories of the speed's drift" in text
    assert re.search(r"attainment [\d.]+-[\d.]+% \(outside\)", text)
    assert re.search(r"TTFT p90 [\d.]+-[\d.]+ s \(inside\)", text)
