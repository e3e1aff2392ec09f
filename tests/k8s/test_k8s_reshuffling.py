"""The reshuffle planner, table-driven: which instances stay, the order of creates,
drains and deletes, and the capacity rule, on clusters with and without free GPUs."""

from __future__ import annotations

import pytest

from distserve.k8s import reshuffling
from distserve.k8s.reshuffling import Instance, ReshuffleError, plan_reshuffle


def make_instance(name: str, node: str = "a", first_gpu: int = 0, tp: int = 1,
                  engine_hash: str = "e1") -> Instance:
    """A one-stage instance named like `p0`/`d1` (role from the first letter)."""
    role = "prefill" if name[0] == "p" else "decode"
    return Instance(name, "r", role, int(name[1:]), tp, 1,
                    ((node, tuple(range(first_gpu, first_gpu + tp))),), engine_hash)


def instances(text: str) -> list[Instance]:
    """`p0@a:0x2 d0@a:2` -> instances (name@node:first_gpu[xtp])."""
    found = []
    for word in text.split():
        name, where = word.split("@")
        node, gpus = where.split(":")
        first, _, tp = gpus.partition("x")
        found.append(make_instance(name, node, int(first), int(tp or 1)))
    return found


def sequence(reshuffle: reshuffling.Reshuffle) -> list[str]:
    """`create p1`, `drain d0`, ... in order."""
    return [f"{s.action} {s.instance.name}" for s in reshuffle.steps]


# (why, old, new, free GPUs per node now, expected kept names, expected steps)
CASES = [
    ("identical plans: nothing to do",
     "p0@a:0 d0@a:1", "p0@a:0 d0@a:1", {"a": 0}, ["p0", "d0"], []),
    ("free GPUs: new instances first, then the old ones drain",
     "p0@a:0 d0@a:1", "p0@a:0 d1@a:2", {"a": 6}, ["p0"],
     ["create d1", "drain d0", "delete d0"]),
    ("full node, same count: drain one, delete it, start its replacement, next",
     "p0@a:0 p1@a:1 d0@a:2 d1@a:3", "p0@a:0 p1@a:1 d0@a:2x2", {"a": 0}, ["p0", "p1"],
     ["drain d0", "delete d0", "drain d1", "delete d1", "create d0"]),
    ("full node, ratio moves from prefill to decode one instance at a time",
     "p0@a:0 p1@a:1 p2@a:2 d0@a:3", "p0@a:0 d0@a:3 d1@a:1 d2@a:2", {"a": 0}, ["p0", "d0"],
     ["drain p1", "delete p1", "create d1", "drain p2", "delete p2", "create d2"]),
    ("an instance moved to another node with room goes there before the old one drains",
     "p0@a:0 d0@a:1", "p0@a:0 d0@b:0", {"a": 0, "b": 1}, ["p0"],
     ["create d0", "drain d0", "delete d0"]),
    ("room for two new instances freed by two drains: both drain, then both load together",
     "p0@a:0x2 d0@a:2x2", "p0@b:0x2 d0@b:2x2 p1@a:0x3 d1@a:3", {"a": 0, "b": 4}, [],
     ["create p0", "create d0", "drain d0", "delete d0", "drain p0", "delete p0",
      "create p1", "create d1"]),
    ("no drain ahead of its round where it alone gives no new instance room",
     "p0@a:0 p1@a:1 d0@a:2 d1@a:3", "p0@a:0x2 d0@a:2x2", {"a": 0}, [],
     ["drain p0", "delete p0", "drain p1", "delete p1", "create p0", "drain d0", "delete d0",
      "drain d1", "delete d1", "create d0"]),
    ("a smaller plan: the extra instances drain last",
     "p0@a:0 p1@a:1 d0@a:2 d1@a:3", "p0@a:0 d0@a:2", {"a": 0}, ["p0", "d0"],
     ["drain p1", "delete p1", "drain d1", "delete d1"]),
]


@pytest.mark.parametrize("why,old,new,free,kept,expected", CASES, ids=[c[0] for c in CASES])
def test_reshuffle_steps(why, old, new, free, kept, expected):
    result = plan_reshuffle(instances(old), instances(new), free)
    assert sorted(i.name for i in result.kept) == sorted(kept)
    assert sequence(result) == expected


def test_an_engine_change_keeps_nothing_and_replaces_one_by_one():
    old = instances("p0@a:0 d0@a:1")
    new = [make_instance("p0", "a", 0, engine_hash="e2"), make_instance("d0", "a", 1, engine_hash="e2")]
    result = plan_reshuffle(old, new, {"a": 0})
    assert result.kept == ()
    assert sequence(result) == ["drain p0", "delete p0", "create p0", "drain d0", "delete d0",
                                "create d0"]


def test_capacity_never_drops_below_the_smaller_plan_minus_one():
    old = instances("p0@a:0 p1@a:1 p2@a:2 p3@a:3 d0@a:4 d1@a:5 d2@a:6 d3@a:7")
    new = instances("p0@a:0x2 p1@a:2x2 d0@a:4x2 d1@a:6x2")
    result = plan_reshuffle(old, new, {"a": 0})
    floors = {"prefill": 1, "decode": 1, "*": 3}
    for serving in reshuffling.serving_counts(old, result.steps):
        assert all(serving[k] >= floor for k, floor in floors.items()), serving


def test_a_plan_that_needs_more_gpus_than_exist_is_refused_naming_the_instance():
    with pytest.raises(ReshuffleError, match=r"d0 needs 2 GPUs on a \(1 free\)"):
        plan_reshuffle(instances("p0@a:0"), instances("p0@a:0 d0@a:1x2"), {"a": 1})


def test_a_tp_change_of_the_only_instance_on_a_full_node_may_pause_that_phase():
    # the smaller plan minus one is zero prefill instances: allowed, and the only way
    result = plan_reshuffle(instances("p0@a:0 d0@a:1"), instances("p0@a:0x2"), {"a": 0})
    assert sequence(result) == ["drain p0", "delete p0", "drain d0", "delete d0", "create p0"]


def test_the_capacity_check_rejects_steps_that_drain_two_before_a_create():
    old = instances("p0@a:0 p1@a:1 d0@a:2 d1@a:3")
    new = instances("p0@a:0x2 d0@a:2 d1@a:3")
    bad = reshuffling.Reshuffle((), tuple(reshuffling.Step(a, i) for a, i in [
        ("drain", old[0]), ("delete", old[0]), ("drain", old[2]), ("delete", old[2]),
        ("drain", old[1]), ("delete", old[1]), ("create", new[0]), ("create", new[1])]))
    with pytest.raises(ReshuffleError, match="below"):
        reshuffling.check_capacity(old, new, bad)
