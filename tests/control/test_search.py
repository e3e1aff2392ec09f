"""The placement search: goodput bisection, Algorithms 1 and 2, GPU assignment, failures."""

from __future__ import annotations

import dataclasses

import pytest

from distserve.catalog import get_model
from distserve.search import NoFeasiblePlan, build_context, find_goodput, plan_deployment
from distserve.search.algorithms import balance, phase_table
from distserve.search.candidates import ClusterShape, Config, instance_configs, segment_configs
from distserve.search.curves import plan_unit
from distserve.search.goodput import MAX_RATE_RPS, REL_TOL, find_goodput_wide
from distserve.search.planner import SearchOverrides, placed_as_given
from distserve.search.trials import Unit, run_unit, unit_goodput
from distserve.simulator import SLO
from distserve.spec import DistServeDeploymentSpec


def make_spec(**overrides) -> DistServeDeploymentSpec:
    """OPT-13B chatbot on one node of 4 A100s, small trials, one worker."""
    doc = {
        "model": {"name": "facebook/opt-13b"},
        "slo": {"ttftSeconds": 0.4, "tpotSeconds": 0.1},
        "cluster": {"nodes": 1, "gpusPerNode": 4, "accelerator": "A100-80GB"},
        "planner": {"numRequests": 100, "workers": 1},
    }
    for key, value in overrides.items():
        doc[key] = {**doc.get(key, {}), **value} if isinstance(value, dict) else value
    return DistServeDeploymentSpec.model_validate(doc)


class _Trial:
    """A fake trial whose attainment drops below 90% above a known rate."""

    def __init__(self, limit_rps: float) -> None:
        self.limit_rps = limit_rps

    def __call__(self, rate, slo):
        ok = 1.0 if rate <= self.limit_rps else 0.5

        class Result:
            def attainment(self, _slo):
                return ok

        return Result()


@pytest.mark.parametrize("estimate", [0.1, 3.0, 500.0])
def test_bisection_finds_the_rate_where_attainment_drops(estimate):
    goodput = find_goodput(_Trial(7.3), SLO(1.0, 1.0, 0.9), estimate)
    assert 7.3 * 0.97 <= goodput.rate_rps <= 7.3


def test_a_known_bracket_is_narrowed_not_searched_again():
    coarse = find_goodput(_Trial(7.3), SLO(1.0, 1.0, 0.9), 3.0, rel_tol=0.1)
    fine = find_goodput(_Trial(7.3), SLO(1.0, 1.0, 0.9), 3.0, rel_tol=0.01, known=coarse)
    assert coarse.rate_rps <= 7.3 < coarse.fail_rps
    assert 7.3 * 0.99 <= fine.rate_rps <= 7.3 < fine.fail_rps <= coarse.fail_rps
    assert fine.trials - coarse.trials <= 4  # only the bracket's halvings


class _Batch:
    """Fake trials run a batch at a time, each batch's rates recorded."""

    def __init__(self, limit_rps: float) -> None:
        self.limit_rps, self.batches = limit_rps, []

    def __call__(self, rates):
        self.batches.append(list(rates))
        return [1.0 if rate <= self.limit_rps else 0.5 for rate in rates]


@pytest.mark.parametrize("estimate", [0.1, 3.0, 7.0, 500.0])
def test_a_wide_bisection_finds_the_same_rate_two_trials_at_a_time(estimate):
    trials = _Batch(7.3)
    goodput = find_goodput_wide(trials, SLO(1.0, 1.0, 0.9), estimate, width=2)
    assert 7.3 * 0.97 <= goodput.rate_rps <= 7.3 < goodput.fail_rps
    assert goodput.fail_rps - goodput.rate_rps <= REL_TOL * goodput.rate_rps
    assert all(len(batch) == 2 for batch in trials.batches)
    assert goodput.trials == len({rate for batch in trials.batches for rate in batch})
    # one by one it takes more rounds than two at a time
    assert len(trials.batches) < find_goodput(_Trial(7.3), SLO(1.0, 1.0, 0.9), estimate).trials


def test_a_wide_bisection_does_not_run_a_known_rate_again():
    trials = _Batch(7.3)
    goodput = find_goodput_wide(trials, SLO(1.0, 1.0, 0.9), 6.0, width=2, known={6.0: 0.95})
    assert 6.0 not in {rate for batch in trials.batches for rate in batch}
    assert 7.3 * 0.97 <= goodput.rate_rps <= 7.3
    # a known pass that stays the answer keeps its attainment
    goodput = find_goodput_wide(_Batch(6.05), SLO(1.0, 1.0, 0.9), 6.0, width=2, known={6.0: 0.95})
    assert (goodput.rate_rps, goodput.attainment) == (6.0, 0.95)


def test_a_wide_bisection_of_the_unattainable_or_the_unlimited_ends():
    nothing = find_goodput_wide(_Batch(-1.0), SLO(1, 1, 0.9), 1.0, width=2)
    assert nothing.rate_rps == 0.0 and nothing.attainment == 0.5
    everything = find_goodput_wide(_Batch(float("inf")), SLO(1, 1, 0.9), 1.0, width=2)
    assert everything.rate_rps == MAX_RATE_RPS


def test_unattainable_slo_has_zero_goodput():
    goodput = find_goodput(lambda rate, slo: _Trial(-1.0)(rate, slo), SLO(1, 1, 0.9), 1.0)
    assert goodput.rate_rps == 0.0 and goodput.attainment == 0.5


def test_balance_gives_the_slower_phase_more_instances():
    n_prefill, n_decode, bound = balance(10.0, 1, 4.0, 1, max_gpus=8)
    assert (n_prefill, n_decode) == (2, 5) and bound == 20.0


def test_low_affinity_plan_pins_matching_stages_to_one_node():
    plan = plan_deployment(make_spec())
    assert plan.algorithm == "low-affinity"
    assert 0 < plan.num_gpus <= 4 and plan.per_gpu_goodput_rps > 0
    assert plan.attainment >= 0.9
    taken = [(s.node, g) for s in plan.segments for g in s.gpu_ids]
    assert len(taken) == len(set(taken)) == plan.num_gpus
    assert {s.node for s in plan.segments} == {"node-0"}
    assert set(plan.baselines) == {"colocated", "chunked_prefill"}
    assert all(b.per_gpu_goodput_rps > 0 for b in plan.baselines.values())


@pytest.mark.slow
def test_high_affinity_sizes_instances_for_the_rate():
    small = plan_deployment(make_spec(
        cluster={"nodes": 2, "nodeAffinity": "high"}, workload={"rateRps": 2.0}))
    large = plan_deployment(make_spec(
        cluster={"nodes": 2, "nodeAffinity": "high"}, workload={"rateRps": 20.0}))
    assert small.algorithm == large.algorithm == "high-affinity"
    assert large.num_gpus > small.num_gpus
    assert large.goodput_rps > small.goodput_rps


def test_replicated_units_serve_the_rate_when_simulated_together():
    spec = make_spec(cluster={"nodes": 3}, workload={"rateRps": 30.0})
    plan = plan_deployment(spec)
    assert plan.algorithm == "low-affinity" and plan.goodput_rps >= 30.0
    assert plan.prefill.instances > 1 and len({s.node for s in plan.segments}) > 1
    # the goodput reported is the whole deployment's, not copies x one unit's
    ctx = build_context(spec)
    whole = run_unit(ctx, plan_unit(ctx, plan), plan.goodput_rps, None)
    assert whole.attainment(ctx.slo) >= 0.9


def test_trials_keep_decode_on_node_where_the_deployment_s_router_will():
    fixed = {"prefill": {"tp": 2, "pp": 1, "instances": 1},
             "decode": {"tp": 1, "pp": 1, "instances": 2}}
    assert not build_context(make_spec()).can_decode_across_nodes  # auto: low affinity
    assert not build_context(make_spec(placement=fixed)).can_decode_across_nodes
    high = {"nodeAffinity": "high"}
    assert build_context(make_spec(cluster=high)).can_decode_across_nodes
    assert build_context(make_spec(cluster=high, placement=fixed)).can_decode_across_nodes
    assert build_context(make_spec(planner={"algorithm": "high-affinity"})).can_decode_across_nodes


def test_fixed_placement_is_simulated_not_searched():
    plan = plan_deployment(make_spec(placement={
        "prefill": {"tp": 2, "pp": 1, "instances": 1}, "decode": {"tp": 1, "pp": 1, "instances": 2},
    }))
    assert plan.algorithm == "fixed"
    assert (plan.prefill.tp, plan.prefill.instances, plan.decode.instances) == (2, 1, 2)
    assert plan.num_gpus == 4 and plan.goodput_rps > 0


def test_a_placement_that_meets_no_rate_is_still_placed_for_a_replanner_to_start_from():
    placement = {"prefill": {"tp": 2, "pp": 1, "instances": 1},
                 "decode": {"tp": 1, "pp": 1, "instances": 2}}
    spec = make_spec(slo={"ttftSeconds": 0.001}, placement=placement)
    with pytest.raises(NoFeasiblePlan) as err:
        plan_deployment(spec)
    start = placed_as_given(spec, attainment=err.value.best_attainment)
    assert start.algorithm == "fixed" and start.goodput_rps == 0.0 and start.latency is None
    assert (start.prefill.tp, start.prefill.instances, start.decode.instances) == (2, 1, 2)
    assert start.num_gpus == 4 and len(start.segments) == 3
    assert start.attainment == err.value.best_attainment < 0.9
    with pytest.raises(ValueError, match="no placement"):
        placed_as_given(make_spec())


def test_model_that_fits_nowhere_says_so():
    with pytest.raises(NoFeasiblePlan) as err:
        plan_deployment(make_spec(model={"name": "facebook/opt-175b"}, cluster={"gpusPerNode": 2}))
    assert "fits no placement" in err.value.reason and err.value.best_attainment == 0.0


def test_unattainable_slo_reports_the_best_attainment():
    with pytest.raises(NoFeasiblePlan) as err:
        plan_deployment(make_spec(slo={"ttftSeconds": 0.001}))
    assert "no request rate meets" in err.value.reason
    assert 0.0 <= err.value.best_attainment < 0.9


def test_cluster_too_small_for_the_rate_gets_the_best_plan_that_fits():
    plan = plan_deployment(make_spec(workload={"rateRps": 5000.0}))
    assert 0 < plan.goodput_rps < 5000.0 and plan.num_gpus <= 4
    assert plan.shortfall_rps == 5000.0 - plan.goodput_rps
    assert plan.limited_by == "the cluster (1 nodes x 4 GPUs)"


@pytest.mark.parametrize(("source", "tps"), [("auto", {1, 2, 4}), ("analytic", {1, 2, 4, 5, 8})])
def test_a_profiled_model_is_searched_at_its_profiled_degrees_only(source, tps):
    ctx = build_context(make_spec(planner={"latencyModel": source}))
    model, cluster = get_model(ctx.model), ClusterShape(1, 8, 1)
    configs = instance_configs(model, ctx.accelerator, cluster, 2048, ctx.latency)
    assert {tp for tp, _ in configs} == tps  # Algorithm 1 and the baselines
    segments = segment_configs(model, ctx.accelerator, cluster, 1, 2048, ctx.latency)
    assert {tp for tp, _ in segments} == tps - {8}  # Algorithm 2 leaves a GPU to the other phase


def test_fixed_placement_at_an_unprofiled_degree_is_refused_under_auto():
    spec = make_spec(cluster={"gpusPerNode": 8}, placement={
        "prefill": {"tp": 5, "pp": 1, "instances": 1}, "decode": {"tp": 1, "pp": 1, "instances": 1},
    })
    with pytest.raises(NoFeasiblePlan, match="latencyModel: analytic"):
        plan_deployment(spec)


def test_goodput_search_stops_at_its_cap_for_a_deployment_that_never_misses():
    from distserve.search.goodput import MAX_RATE_RPS

    class AlwaysMet:
        def attainment(self, slo):
            return 1.0

    rates = []

    def trial(rate, slo):
        rates.append(rate)
        return AlwaysMet()

    for estimate in (5.0, float("inf")):
        rates.clear()
        found = find_goodput(trial, SLO(1.0, 0.1, 0.9, "both"), estimate)
        assert found.rate_rps == MAX_RATE_RPS and all(r <= MAX_RATE_RPS for r in rates)


def test_a_pair_ranked_last_by_its_phases_alone_is_still_found_when_best():
    # OPT-13B, TTFT 0.25 s: one tp1 prefill instance alone meets TTFT for 90% at about
    # 2.6 req/s, two behind one dispatcher at about 11 (they pool their queues), so the
    # pair's estimate from its phases alone is under half its joint goodput and ranks it
    # last; the old pruning stopped before it.
    spec = make_spec(slo={"ttftSeconds": 0.25})
    ctx = build_context(spec)
    table = phase_table(lambda fn, args: [fn(*a) for a in args], ctx, [Config(1, 1), Config(2, 1)])
    pair = Unit(Config(1, 1), Config(2, 1), 2, 1, ctx.intra_node_bytes_per_s)
    estimate_rps = min(2 * table[("prefill", Config(1, 1))].rate_rps,
                       table[("decode", Config(2, 1))].rate_rps)
    joint_rps = unit_goodput(ctx, pair).rate_rps
    assert joint_rps > 1.5 * estimate_rps
    plan = plan_deployment(spec, overrides=SearchOverrides(with_baselines=False))
    assert plan.per_gpu_goodput_rps >= joint_rps / pair.num_gpus * (1 - REL_TOL)


def test_a_router_that_admits_by_ttft_is_planned_with_its_refusals():
    """spec.router.admitByTtft: the search refuses as that router does, each refusal a
    miss, so the plan's goodput is the rate such a router serves within the SLOs: higher
    than without refusals, and one at which the same instances without them miss the
    target."""
    fixed = {"placement": {"prefill": {"tp": 1, "pp": 1, "instances": 1},
                           "decode": {"tp": 1, "pp": 1, "instances": 1}},
             "cluster": {"gpusPerNode": 2}}
    queueing = make_spec(**fixed)
    refusing = make_spec(**fixed, router={"admitByTtft": True})
    assert not build_context(queueing).admit_by_ttft
    ctx = build_context(refusing)
    assert ctx.admit_by_ttft and ctx.admit_by_ttft_s == refusing.slo.ttft_seconds
    served = plan_deployment(queueing)
    admitted = plan_deployment(refusing)
    assert admitted.goodput_rps > served.goodput_rps * (1 + REL_TOL)
    assert admitted.attainment >= 0.9
    unit = plan_unit(ctx, admitted)
    at_its_goodput = run_unit(ctx, unit, admitted.goodput_rps, None)
    assert at_its_goodput.num_refused > 0 and at_its_goodput.attainment(ctx.slo) >= 0.9
    without = run_unit(dataclasses.replace(ctx, admit_by_ttft=False), unit,
                       admitted.goodput_rps, None)
    assert without.num_refused == 0 and without.attainment(ctx.slo) < 0.9
