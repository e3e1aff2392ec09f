"""The simulator's prediction of a local run: the very requests sent, on the settings' instances."""

from __future__ import annotations

from pathlib import Path

import pytest

from distserve.local.prediction import LocalShape, engine_context, predict_run
from distserve.local.settings import serve_settings
from distserve.search import build_context
from distserve.search.trials import instance_model
from distserve.spec import load_manifest
from distserve.workload import Request

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(("instances", "engine"), [
    ({"prefill": 1, "decode": 1}, "disaggregated"), ({"colocated": 2}, "colocated"),
])
def test_each_request_alone_waits_only_for_its_own_prefill(instances, engine):
    spec = load_manifest(EXAMPLES / "local.yaml").spec
    settings = serve_settings(spec, instances, "test", "/model")
    ctx = engine_context(build_context(spec), settings)
    requests = [Request(0, 0.0, 100, 5), Request(1, 100.0, 300, 8)]  # far apart: no queue
    summary = predict_run(ctx, LocalShape.from_settings(settings), requests, 0.02)
    timer = instance_model(ctx, engine, (1, 1)).timer
    alone_s = [timer.prefill_iteration_s((n,)) for n in (100, 300)]
    assert (summary.num_requests, summary.num_errors, summary.attainment) == (2, 0, 1.0)
    assert summary.ttft_p_s[50] == pytest.approx(sum(alone_s) / 2)  # the median of two
    assert summary.rate_rps == 0.02
