"""The plan's id and predictions reach the engine's settings on every path (metrics)."""

from __future__ import annotations

import json

from k8s_factories import make_owner, make_revision

from distserve.k8s import router, workers
from distserve.local.settings import serve_settings
from distserve_engine.server.settings import ServeSettings


def test_instance_and_router_settings_name_the_plan_and_its_predictions():
    owner, revision = make_owner(), make_revision()
    plan = revision.plan
    expected = {"id": plan.plan_id, "predicted_attainment": plan.attainment,
                "predicted_goodput_rps": plan.goodput_rps,
                "prefill": f"tp{plan.prefill.tp}pp{plan.prefill.pp}x{plan.prefill.instances}",
                "decode": f"tp{plan.decode.tp}pp{plan.decode.pp}x{plan.decode.instances}"}
    instance_doc = json.loads(workers.build_engine_config_map_spec(revision)["data"]["serve.json"])
    assert instance_doc["plan"] == expected
    live = [{**e, "draining": False} for e in workers.instance_endpoints(revision)]
    config = router.build_router_config(owner, revision.spec, live, plan=plan)
    router_doc = json.loads(router.build_router_config_map_spec(owner, revision.spec, config)["data"]["serve.json"])
    assert router_doc["plan"] == expected
    settings = ServeSettings.from_dict(router_doc)
    assert settings.plan_metrics()["plan_id"] == plan.plan_id
    assert settings.plan_metrics()["prefill"] == expected["prefill"] == "tp2pp1x1"
    # Without a plan (a fixed placement, a baseline) the document says so and still reads.
    bare = serve_settings(revision.spec, {"prefill": 1, "decode": 1}, "opt", "/models/x")
    assert bare.to_dict()["plan"] is None
    assert ServeSettings.from_dict(bare.to_dict()).plan_metrics() == {"plan_id": None}


def test_every_instance_builds_its_prefill_budgets_products_at_start():
    revision = make_revision()
    instance_doc = json.loads(workers.build_engine_config_map_spec(revision)["data"]["serve.json"])
    budget = revision.spec.planner.max_prefill_tokens or 512
    assert instance_doc["engine"]["prefill_warmup_tokens"] == instance_doc["max_prefill_tokens"] == budget
    assert ServeSettings.from_dict(instance_doc).engine.prefill_warmup_tokens == budget
