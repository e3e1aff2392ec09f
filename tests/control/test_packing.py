"""Planning at cluster scale: copies packed onto nodes, mixed unit shapes, plans that
fall short of the rate, the cluster's capacity, and the GPU budget."""

from __future__ import annotations

import pytest
from test_search import make_spec

from distserve.plan import Plan
from distserve.search import algorithms, build_context, plan_deployment
from distserve.search.algorithms import UnitChoice, _promising
from distserve.search.candidates import ClusterShape
from distserve.search.curves import plan_unit
from distserve.search.goodput import Goodput
from distserve.search.packing import Mix, Room, choose_mix, fewer_gpu_mixes
from distserve.search.placement import place_shapes
from distserve.search.replicas import replicate
from distserve.search.trials import Config, Unit, latency_stats, run_unit, unit_goodput


def make_choice(gpus_per_node: int, goodput_rps: float, nodes: int = 1) -> UnitChoice:
    """A unit of one prefill and one decode segment per node taking gpus_per_node GPUs on
    each of `nodes` nodes, whose joint goodput is goodput_rps."""
    prefill_gpus = gpus_per_node // 2
    prefill = Config(prefill_gpus, nodes)
    decode = Config(gpus_per_node - prefill_gpus, nodes)
    return UnitChoice(Unit(prefill, decode, 1, 1, 1e9), nodes, Goodput(goodput_rps, 0.9, 1))


def room(nodes: int = 4, gpus_per_node: int = 8, max_gpus: int | None = None) -> Room:
    return Room([f"n{i}" for i in range(nodes)], gpus_per_node, max_gpus or nodes * gpus_per_node)


def test_a_unit_that_fills_nodes_beats_a_better_per_gpu_one_that_strands_gpus():
    strands = make_choice(6, 6.0)  # 1.0 req/s per GPU, 2 of 8 GPUs idle on every node
    fills = make_choice(8, 7.2)  # 0.9 req/s per GPU
    mix = choose_mix([strands, fills], room(), 28.0)
    # 5 copies of the 6-GPU unit would serve 30, but only 4 fit (24 req/s)
    assert mix.shapes == ((fills, 4),) and mix.estimate_rps >= 28.0
    # a lower rate mixes the two: 3 copies that fill nodes, 1 that strands (30 GPUs)
    mixed = choose_mix([strands, fills], room(), 26.0)
    assert mixed.shapes == ((fills, 3), (strands, 1)) and mixed.num_gpus == 30


def test_the_stranding_unit_wins_when_its_copies_fit():
    strands, fills = make_choice(6, 6.0), make_choice(8, 7.2)
    mix = choose_mix([strands, fills], room(), 17.0)
    assert mix.shapes == ((strands, 3),) and mix.num_gpus == 18


def test_a_second_shape_fills_the_gpus_the_first_leaves_free():
    main = make_choice(6, 6.0)
    small = make_choice(2, 1.6)
    alone = [choose_mix([c], room(), None).estimate_rps for c in (main, small)]
    assert alone == [24.0, pytest.approx(25.6)]  # 4 copies; 16 copies
    mix = choose_mix([main, small], room(), 30.0)
    assert mix.shapes == ((main, 4), (small, 4)) and mix.num_gpus == 32
    assert mix.estimate_rps == pytest.approx(30.4)
    segments = place_shapes(room().node_names, 8, mix.placed())
    taken = [(s.node, g) for s in segments for g in s.gpu_ids]
    assert len(taken) == len(set(taken)) == 32
    # the second shape's instances are numbered after the first's
    assert sorted({s.instance for s in segments if s.role == "decode"}) == list(range(8))


def test_without_a_rate_the_mix_serving_the_most_is_chosen():
    main, small = make_choice(6, 6.0), make_choice(2, 1.6)
    mix = choose_mix([main, small], room(), None)
    assert mix.estimate_rps == pytest.approx(30.4)


def test_the_gpu_budget_bounds_the_copies():
    main, small = make_choice(6, 6.0), make_choice(2, 1.6)
    mix = choose_mix([main, small], room(max_gpus=20), 100.0)
    assert mix.num_gpus <= 20
    assert mix.shapes[0] == (main, 3)


def test_fewer_copies_with_a_filler_are_tried_before_a_copy_too_many():
    main, small = make_choice(6, 6.0), make_choice(2, 1.6)
    serving = Mix(((main, 5),))  # 30 GPUs estimated at 30 req/s, for a rate of 26.4
    tried = fewer_gpu_mixes([main, small], room(nodes=8), 26.4, serving, ratio=1.0)
    assert tried == [Mix(((main, 4), (small, 2))), Mix(((main, 3), (small, 5)))]
    assert all(mix.num_gpus == 28 and mix.estimate_rps >= 26.0 for mix in tried)
    # simulated at 90% of the estimate, the fillers that make up for it take more GPUs
    assert fewer_gpu_mixes([main, small], room(nodes=8), 26.4, serving, ratio=0.9) == []


def test_a_mix_estimated_just_short_of_the_rate_is_tried_too():
    # 4 x 6.0 + 1 x 1.6 = 25.6 req/s, 1.5% short of 26: within what one bisection can
    # misjudge the ratio by, so worth its one trial (fewer GPUs are tried first)
    main, small = make_choice(6, 6.0), make_choice(2, 1.6)
    tried = fewer_gpu_mixes([main, small], room(nodes=8), 26.0, Mix(((main, 5),)), ratio=1.0)
    assert tried[0] == Mix(((main, 4), (small, 1)))
    assert tried[0].num_gpus == 26
    # 3% short is not
    tried = fewer_gpu_mixes([main, small], room(nodes=8), 26.4, Mix(((main, 5),)), ratio=1.0)
    assert Mix(((main, 4), (small, 1))) not in tried


def test_nothing_fits_a_node_too_small():
    assert choose_mix([make_choice(8, 7.2)], room(gpus_per_node=4), 5.0) is None


def _shapes(plan: Plan) -> dict[str, list[tuple[int, int, int]]]:
    return {role: [(g.tp, g.pp, g.instances) for g in plan.groups(role)]
            for role in ("prefill", "decode")}


def _assert_consistent(plan: Plan) -> None:
    """Every instance of every group has its segments on distinct GPUs."""
    taken = [(s.node, g) for s in plan.segments for g in s.gpu_ids]
    assert len(taken) == len(set(taken)) == plan.num_gpus
    for role in ("prefill", "decode"):
        for i in range(plan.num_instances(role)):
            phase = plan.phase_of(role, i)
            stages = plan.segments_of(role, i)
            assert [s.stage for s in stages] == list(range(phase.pp))
            assert all(len(s.gpu_ids) == phase.tp for s in stages)
    assert Plan.from_dict(plan.to_dict()) == plan


def test_capacity_fills_the_cluster_with_copies_simulated_whole():
    # (whether a second shape fills in depends on which units the search shortlists;
    # a mixed plan is shown where one is needed, below)
    spec = make_spec(cluster={"nodes": 2, "gpusPerNode": 6})
    plan = plan_deployment(spec, is_capacity=True)
    assert plan.num_gpus == 12
    assert plan.rate_rps is None and plan.shortfall_rps == 0.0
    assert "2 nodes x 6 GPUs" in plan.limited_by
    _assert_consistent(plan)
    ctx = build_context(spec)
    whole = run_unit(ctx, plan_unit(ctx, plan), plan.goodput_rps, None)
    assert whole.attainment(ctx.slo) >= 0.9
    # the plan's percentiles, kept from the bisection's trial at its goodput, are those
    # of a full trial there
    assert plan.latency == latency_stats(whole) and plan.attainment == whole.attainment(ctx.slo)


def test_a_rate_beyond_the_cluster_gets_the_best_plan_that_fits_and_its_shortfall():
    spec = make_spec(cluster={"nodes": 2, "gpusPerNode": 6}, workload={"rateRps": 500.0})
    plan = plan_deployment(spec)
    assert 0 < plan.goodput_rps < 500.0 and plan.num_gpus <= 12
    assert plan.shortfall_rps == pytest.approx(500.0 - plan.goodput_rps)
    assert "the cluster" in plan.limited_by
    assert plan.to_dict()["shortfall_rps"] == pytest.approx(plan.shortfall_rps)
    _assert_consistent(plan)


def test_the_plan_stays_within_the_gpu_budget():
    spec = make_spec(cluster={"nodes": 2, "gpusPerNode": 6}, workload={"rateRps": 500.0},
                     planner={"maxGpus": 5})
    plan = plan_deployment(spec)
    assert plan.num_gpus <= 5 and plan.shortfall_rps > 0
    assert "planner.maxGpus" in plan.limited_by


def test_a_rate_the_cluster_serves_has_no_shortfall():
    spec = make_spec(cluster={"nodes": 2, "gpusPerNode": 6}, workload={"rateRps": 20.0})
    plan = plan_deployment(spec)
    assert plan.goodput_rps >= 20.0 and plan.shortfall_rps == 0.0 and plan.limited_by == ""
    assert plan.num_gpus < 12  # fewer GPUs than the capacity plan
    _assert_consistent(plan)


def test_plans_of_one_shape_keep_their_ids_and_documents():
    plan = plan_deployment(make_spec())
    doc = plan.to_dict()
    assert doc["extra_prefill"] == [] and doc["extra_decode"] == []
    old = {k: v for k, v in doc.items() if k not in ("extra_prefill", "extra_decode", "limited_by")}
    assert Plan.from_dict(old).plan_id == plan.plan_id == doc["id"]
    assert _shapes(plan)["prefill"] == [(plan.prefill.tp, plan.prefill.pp, plan.prefill.instances)]


def _unit_choice(ctx, num_prefill: int, num_decode: int) -> UnitChoice:
    """A one-node unit of tp1 instances, its goodput simulated."""
    unit = Unit(Config(1, 1), Config(1, 1), num_prefill, num_decode, ctx.intra_node_bytes_per_s)
    return UnitChoice(unit, 1, unit_goodput(ctx, unit))


def _inline(fn, arg_tuples):
    return [fn(*args) for args in arg_tuples]


def test_a_mixed_plan_serves_a_rate_neither_shape_alone_can():
    # 2 nodes x 5 GPUs: a 3-GPU unit (1 prefill, 2 decode) fits once per node and a 2-GPU
    # one (1 + 1) twice, so each shape alone strands GPUs that the two together fill
    spec = make_spec(cluster={"nodes": 2, "gpusPerNode": 5})
    ctx = build_context(spec)
    wide, narrow = _unit_choice(ctx, 1, 2), _unit_choice(ctx, 1, 1)
    nodes = room(nodes=2, gpus_per_node=5)
    rate_rps = 28.0
    alone = [replicate(_inline, ctx, [shape], rate_rps, nodes, _silent) for shape in (wide, narrow)]
    assert [r.mix.num_gpus for r in alone] == [6, 8]
    assert all(r.is_limited and r.goodput.rate_rps < rate_rps for r in alone)
    mixed = replicate(_inline, ctx, [wide, narrow], rate_rps, nodes, _silent)
    assert not mixed.is_limited and mixed.goodput.rate_rps >= rate_rps
    assert {choice for choice, _ in mixed.mix.shapes} == {wide, narrow}
    assert mixed.mix.num_gpus <= 10
    # the deployment simulated whole, as planned, meets the SLOs at the rate
    result = run_unit(ctx, mixed.whole, rate_rps, None)
    assert result.attainment(ctx.slo) >= ctx.slo.attainment
    for shape in alone:
        assert run_unit(ctx, shape.whole, rate_rps, None).attainment(ctx.slo) < ctx.slo.attainment


def _silent(_: str) -> None:
    pass


def test_the_plan_does_not_depend_on_the_number_of_workers():
    # the phase table's waves and a whole deployment's trials, two at a time, are the
    # same on one worker as on two: one spec, one plan
    plans = [plan_deployment(make_spec(
        cluster={"nodes": 2, "gpusPerNode": 6, "nodeAffinity": "low"},
        workload={"rateRps": 20.0}, planner={"workers": workers},
    )) for workers in (1, 2)]
    one, two = ({k: v for k, v in plan.to_dict().items() if k != "search_seconds"}
                for plan in plans)
    assert one == two
    assert plans[0].is_mixed or plans[0].num_gpus < 12  # copies were packed, not one unit


def test_phases_of_pairs_estimated_far_below_the_best_are_not_simulated():
    # three pairs on 8-GPU nodes, by their phases' estimates (req/s per instance):
    # A 5 req/s per GPU on 4 GPUs a node; B 1 per GPU, same footprint; C 1.5 per GPU,
    # the only pair of 2 GPUs a node
    a_prefill, a_decode, b_prefill, b_decode = Config(2, 1), Config(1, 2), Config(1, 2), Config(2, 1)
    one_gpu = Config(1, 1)
    pairs = [(1, a_prefill, a_decode, a_prefill, a_decode),
             (1, b_prefill, b_decode, b_prefill, b_decode),
             (1, one_gpu, one_gpu, one_gpu, one_gpu)]
    estimates = {("prefill", a_prefill): 20.0, ("decode", a_decode): 20.0,
                 ("prefill", b_prefill): 4.0, ("decode", b_decode): 4.0,
                 ("prefill", one_gpu): 3.0, ("decode", one_gpu): 3.0}
    kept = _promising(ClusterShape(4, 8, 4), pairs, estimates.__getitem__)
    # B is under half of A's; C is too, but no other pair fills 2 GPUs a node
    assert kept == {("prefill", a_prefill), ("decode", a_decode),
                    ("prefill", one_gpu), ("decode", one_gpu)}


def test_leaving_out_unpromising_phases_keeps_the_plan(monkeypatch):
    spec = make_spec(cluster={"nodes": 2, "gpusPerNode": 6, "nodeAffinity": "low"},
                     workload={"rateRps": 20.0})
    runs = []
    for share in (0.0, algorithms.PROMISING_SHARE):  # 0: every pair's phases simulated
        monkeypatch.setattr(algorithms, "PROMISING_SHARE", share)
        lines: list[str] = []
        plan = plan_deployment(spec, progress=lines.append)
        simulated = next(line for line in lines if "phase simulations for pairs" in line)
        runs.append(({k: v for k, v in plan.to_dict().items() if k != "search_seconds"},
                     int(simulated.split(": ")[1].split()[0])))
    (every, every_count), (promising, promising_count) = runs
    assert promising == every
    assert promising_count < every_count
