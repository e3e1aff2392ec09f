"""A new plan placed beside the one that serves: the reshuffle starts it on free GPUs."""

from __future__ import annotations

from dataclasses import replace

from decision_factories import make_plan

from distserve.analyzer.scaling import (
    copies_in_place,
    copy_unit,
    dark_phases,
    free_beside,
    move_pieces,
    place_copies,
    placed_beside,
    plan_instances,
    reshuffle_loadings,
    reshuffle_steps,
)
from distserve.k8s.reshuffling import plan_reshuffle
from distserve.plan import PhaseConfig, Plan
from distserve.search.candidates import Config
from distserve.search.placement import pair_links, place_units
from distserve.search.trials import Unit

NODES = [f"node-{i}" for i in range(4)]


def placed(prefill: tuple[int, int], decode: tuple[int, int], copies: int = 1) -> Plan:
    """Copies of one prefill + one decode instance, each copy's pair on one node (low affinity)."""
    unit = Unit(Config(*prefill), Config(*decode), 1, 1, 1.0)
    return replace(make_plan((prefill, decode, 1, 1), copies),
                   segments=place_units(NODES, 8, unit, 1, copies))


def steps(old: Plan, new: Plan) -> list[str]:
    reshuffle = plan_reshuffle(plan_instances(old, "a"), plan_instances(new, "b"),
                               free_beside(old, NODES, 8))
    return [s.action for s in reshuffle.steps]


def test_a_new_shape_starts_on_free_nodes_instead_of_draining_the_instances_that_serve():
    current = placed((2, 2), (3, 1))  # 7 GPUs of node-0
    new = placed((2, 1), (2, 1))  # the search places it on node-0 too
    assert {s.node for s in new.segments} == {"node-0"}
    # as placed, a prefill instance must drain first: for a weight loading no prefill serves
    assert steps(current, new)[0] == "drain"
    assert dark_phases(current, new, NODES, 8) == ("prefill",)
    beside = placed_beside(current, new, NODES, 8)
    assert {s.node for s in beside.segments} == {"node-1"}
    assert steps(current, beside) == ["create", "create", "drain", "delete", "drain", "delete"]
    assert dark_phases(current, beside, NODES, 8) == ()
    # the same shape on alike nodes: the same links, so the same predicted figures
    assert pair_links(beside.segments, 2.0, 1.0) == pair_links(new.segments, 2.0, 1.0)
    assert (beside.prefill, beside.decode) == (new.prefill, new.decode)


def test_a_plan_sharing_instances_or_gaining_no_room_is_left_as_placed():
    current = placed((2, 2), (3, 1), copies=4)  # 7 GPUs on every node, one free each
    new = placed((1, 1), (1, 1))
    assert placed_beside(current, new, NODES, 8) == new  # no node has more room than another
    current = placed((2, 1), (2, 1), copies=2)
    grown = placed((2, 1), (2, 1), copies=3)  # the two copies that serve stay where they are
    assert placed_beside(current, grown, NODES, 8) == grown
    assert steps(current, grown) == ["create", "create"]
    assert dark_phases(current, grown, NODES, 8) == ()
    # a plan no step order reaches (a node the cluster lacks): both phases dark
    elsewhere = replace(grown, segments=tuple(replace(s, node="node-9") for s in grown.segments))
    assert dark_phases(current, elsewhere, NODES, 8) == ("prefill", "decode")


def test_a_move_on_a_full_cluster_counts_its_loadings_in_a_row():
    current = placed((2, 2), (3, 1))  # 7 GPUs of node-0
    beside = placed_beside(current, placed((2, 1), (2, 1)), NODES, 8)
    assert reshuffle_loadings(current, beside, NODES, 8) == 1  # both start on node-1 at once
    assert reshuffle_loadings(current, current, NODES, 8) == 0  # nothing starts
    # every node full (7 of 8 GPUs): each new pair waits for an old one to drain, and a
    # drain waits until the instances started before it serve
    full = placed((2, 2), (3, 1), copies=4)
    other = placed((3, 1), (3, 1), copies=4)
    actions = steps(full, other)
    assert actions[0] == "drain"
    rounds = sum(1 for k, action in enumerate(actions)
                 if action == "create" and (k == 0 or actions[k - 1] != "create"))
    assert reshuffle_loadings(full, other, NODES, 8) == rounds > 1
    # what serves on the way: all four old pairs, then fewer of them beside the new
    # pairs that serve, then the new plan; each drained instance leaves at once, each
    # new one serves a loading after it starts
    pieces = move_pieces(*reshuffle_steps(full, other, NODES, 8))
    assert [moment for moment, _ in pieces] == sorted({moment for moment, _ in pieces})
    names = [{i.name for i in serving} for _, serving in pieces]
    old_names = {i.name for i in plan_instances(full, "old")}
    assert names[0] < old_names and len(names[0]) == 7  # the first drain, at once
    assert names[-1] == {i.name for i in plan_instances(other, "new")}
    assert all(len(n) == 7 for n in names[:-1])  # one instance short until the last serves
    # beside the serving plan: the old pair serves until the new one does (its drains
    # wait for that), so nothing is short on the way
    together = move_pieces(*reshuffle_steps(current, beside, NODES, 8))
    assert [{i.name for i in serving} for _, serving in together] == [
        {i.name for i in plan_instances(current, "old")},
        {i.name for i in plan_instances(beside, "new")}]
    # a plan no step order reaches: one loading per new instance
    elsewhere = replace(beside, segments=tuple(replace(s, node="node-9") for s in beside.segments))
    assert reshuffle_loadings(current, elsewhere, NODES, 8) == 2


def test_copies_of_a_mixed_plans_shape_are_that_shape_only():
    # a mixed plan: copies of one pair, and a group of another shape in each phase
    pair = Unit(Config(3, 2), Config(3, 2), 1, 1, 1.0)  # each stage on its own node
    mixed = replace(make_plan(((3, 2), (3, 2), 1, 1)), segments=place_units(NODES, 8, pair, 2, 1),
                    extra_prefill=(PhaseConfig(2, 1, 2),), extra_decode=(PhaseConfig(3, 1, 2),))
    unit = copy_unit(mixed, 1.0)
    grown = place_copies(mixed, unit, 2, NODES, 8)
    assert not grown.is_mixed
    assert grown.num_gpus == 24
    # every instance it counts has its GPUs: the reshuffle can start each of them
    assert all(i.stages for i in plan_instances(grown, "new"))


def test_more_or_fewer_copies_leave_the_copies_that_serve_where_they_are():
    # a copy placed beside an earlier plan: on node-1 and node-2, not where the search's
    # first fit would put it (node-0 and node-1)
    pair = Unit(Config(3, 2), Config(3, 2), 1, 1, 1.0)  # each stage on its own node
    first_fit = replace(make_plan(((3, 2), (3, 2), 1, 1)), segments=place_units(NODES, 8, pair, 2, 1))
    serving = replace(first_fit, segments=tuple(
        replace(s, node={"node-0": "node-1", "node-1": "node-2"}[s.node]) for s in first_fit.segments))
    unit = copy_unit(serving, 1.0)
    anew = place_copies(serving, unit, 2, NODES, 8)
    # copies placed anew move the one that serves: its phases go dark while they reload
    assert dark_phases(serving, anew, NODES, 8) != ()
    grown = copies_in_place(serving, unit, 2, NODES, 8)
    assert (grown.prefill.instances, grown.decode.instances, grown.num_gpus) == (2, 2, 24)
    assert set(serving.segments) <= set(grown.segments)
    assert steps(serving, grown) == ["create", "create"]
    assert dark_phases(serving, grown, NODES, 8) == ()
    # the new copy's stages share a node per stage, and no GPU is taken twice
    taken = [(s.node, g) for s in grown.segments for g in s.gpu_ids]
    assert len(taken) == len(set(taken)) == 24
    links = pair_links(grown.segments, 2.0, 1.0)
    assert links[1][1] == 2.0
    # fewer copies keep the first ones as they are: the reshuffle only drains the rest
    shrunk = copies_in_place(grown, unit, 1, NODES, 8)
    assert shrunk.segments == serving.segments
    assert steps(grown, shrunk) == ["drain", "delete", "drain", "delete"]
    # a plan that is not copies of the unit is not scaled in place
    other = Unit(Config(2, 1), Config(2, 1), 1, 1, 1.0)
    assert copies_in_place(serving, other, 2, NODES, 8) is None
