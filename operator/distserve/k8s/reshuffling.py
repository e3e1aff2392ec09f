"""From the instances that run to the instances a new plan wants, without spare GPUs.

A reshuffle keeps every instance the two sets share (same role, tp, pp, engine hash, and the
same node and GPUs for every stage) untouched, and replaces the rest one at a time:
- a new instance is created first wherever the node's free GPUs allow;
- otherwise one old instance is drained (the router sends it nothing new, in-flight
  requests finish), deleted, and a new one is created on the GPUs it freed; where the
  new instances that fit then leave another with no room, and one more drain within the
  capacity floors gives it room, that drain comes first and they start together (a
  drain waits for the instances created before it to be Ready: each round of drains
  then creates is one weight loading);
- old instances nothing needs the room of go last.

Capacity never drops below the smaller of the two sets minus one instance, counted
per phase and in all: a drained instance stops counting when its drain starts, a new
one counts once it is created (the executor waits for it to be Ready before the next
drain). `plan_reshuffle` checks this on the steps it returns and raises otherwise.

Pure: instances and free GPU counts per node in, an ordered list of steps out. The
executor (`rollout`) runs the steps, one per monitor round.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

Action = Literal["create", "drain", "delete"]
ROLES = ("prefill", "decode")


class ReshuffleError(ValueError):
    """No step order reaches the new set within the free GPUs and the capacity rule."""


@dataclass(frozen=True)
class Instance:
    """One running or wanted instance: what it is (the key) and what it is called."""

    name: str  # the instance name (`naming.instance_name`), e.g. prefill-0-1a2b3c4d
    revision: str
    role: str
    index: int  # its instance number within its revision's plan
    tp: int
    pp: int
    stages: tuple[tuple[str, tuple[int, ...]], ...]  # (node, GPU ids) per pipeline stage
    engine_hash: str  # what the pods run (the spec's model and engine sections), hashed

    @property
    def key(self) -> tuple:
        """Equal keys: the same instance, kept across plans."""
        return (self.role, self.tp, self.pp, self.stages, self.engine_hash)

    @property
    def node_to_gpus(self) -> Counter:
        """GPUs it takes on each node."""
        counts: Counter = Counter()
        for node, gpu_ids in self.stages:
            counts[node] += len(gpu_ids)
        return counts


@dataclass(frozen=True)
class Step:
    """One thing the executor does; it finishes before the next drain starts."""

    action: Action
    instance: Instance


@dataclass(frozen=True)
class Reshuffle:
    """The plan of a reshuffle: who stays, and the steps for the rest."""

    kept: tuple[Instance, ...]  # the old instances that stay as they are
    steps: tuple[Step, ...]


def match(old: list[Instance], new: list[Instance]) -> tuple[list[Instance], list[Instance], list[Instance]]:
    """(kept old instances, old ones to remove, new ones to add), matched by key."""
    key_to_new: dict[tuple, list[Instance]] = {}
    for instance in new:
        key_to_new.setdefault(instance.key, []).append(instance)
    kept, remove = [], []
    for instance in old:
        twins = key_to_new.get(instance.key)
        if twins:
            twins.pop(0)
            kept.append(instance)
        else:
            remove.append(instance)
    add = [i for twins in key_to_new.values() for i in twins]
    return kept, remove, sorted(add, key=_order)


def _order(instance: Instance) -> tuple:
    """A stable order: by role, then instance number."""
    return (ROLES.index(instance.role) if instance.role in ROLES else 9, instance.index, instance.name)


def _fits(instance: Instance, free: Counter) -> bool:
    """Whether the instance's GPUs are free on every node it spans."""
    return all(free[node] >= gpus for node, gpus in instance.node_to_gpus.items())


def _floors(old: list[Instance], new: list[Instance]) -> dict[str, int]:
    """The least serving instances allowed, per role and in all ("*")."""
    def count(items: list[Instance], role: str | None) -> int:
        return sum(1 for i in items if role is None or i.role == role)
    floors = {role: min(count(old, role), count(new, role)) - 1 for role in ROLES}
    floors["*"] = min(len(old), len(new)) - 1
    return floors


def _serving_after_drain(serving: Counter, instance: Instance) -> Counter:
    """Serving counts once `instance` stops taking requests."""
    after = Counter(serving)
    after[instance.role] -= 1
    after["*"] -= 1
    return after


def _is_within(serving: Counter, floors: dict[str, int]) -> bool:
    """Whether the serving counts respect every floor."""
    return all(serving[k] >= floor for k, floor in floors.items())


def _choose_drain(remove: list[Instance], add: list[Instance], free: Counter,
                  serving: Counter, floors: dict[str, int]) -> Instance | None:
    """The old instance to drain next: one whose GPUs let a new instance fit (of its own
    role first, so each phase loses as little as possible), else one on a node a new
    instance wants; only drains that keep the capacity floors."""
    allowed = [r for r in remove if _is_within(_serving_after_drain(serving, r), floors)]
    if not allowed:
        return None

    def score(candidate: Instance) -> tuple:
        freed = free + candidate.node_to_gpus
        fits = [a for a in add if _fits(a, freed)]
        same_role = any(a.role == candidate.role for a in fits)
        wanted = sum(min(candidate.node_to_gpus[n], g) for a in add for n, g in a.node_to_gpus.items())
        return (bool(fits), same_role, wanted)

    return max(allowed, key=lambda c: (score(c), [-x for x in _order(c)[:2]]))


def _placed(add: list[Instance], free: Counter) -> tuple[list[Instance], Counter]:
    """The instances of `add` that fit one after another, and the GPUs they leave free."""
    left, placed = Counter(free), []
    for instance in add:
        if _fits(instance, left):
            placed.append(instance)
            left -= instance.node_to_gpus
    return placed, left


def _next_in_round(remove: list[Instance], add: list[Instance], free: Counter,
                   serving: Counter, floors: dict[str, int]) -> Instance | None:
    """Another old instance to drain before this round's new instances start, or None.

    NOTE: a drain waits until every instance created before it serves, so a drain
    between two creates adds a weight loading to the reshuffle. Where the new instances
    that fit now leave another with no room, and draining one more old instance now
    keeps the capacity floors and gives it room, that drain comes first and they all
    load together (1 prefill + 1 decode to 2 + 2 of another shape on a cluster it mostly
    fills: two loadings in a row instead of three). A drain that would not yet give any
    of them room waits for the round after, as before."""
    placed, left = _placed(add, free)
    waiting = [a for a in add if a not in placed]
    if not waiting:
        return None
    victim = _choose_drain(remove, waiting, left, serving, floors)
    if victim is None or not any(_fits(a, left + victim.node_to_gpus) for a in waiting):
        return None
    return victim


def plan_reshuffle(old: list[Instance], new: list[Instance], free_gpus: dict[str, int]) -> Reshuffle:
    """The steps from `old` (running) to `new` (wanted). `free_gpus`: node -> GPUs free
    now with the old instances in place (allocatable minus what every pod requests)."""
    kept, remove, add = match(old, new)
    free = Counter({node: max(0, gpus) for node, gpus in free_gpus.items()})
    floors = _floors(old, new)
    serving = Counter({role: sum(1 for i in old if i.role == role) for role in ROLES})
    serving["*"] = len(old)
    steps: list[Step] = []
    while add:
        ready = next((a for a in add if _fits(a, free)), None)
        if ready is not None:
            add.remove(ready)
            free -= ready.node_to_gpus
            serving[ready.role] += 1
            serving["*"] += 1
            steps.append(Step("create", ready))
            continue
        victim = _choose_drain(remove, add, free, serving, floors)
        if victim is None:
            _raise_stuck(add, remove, free)
        while victim is not None:
            remove.remove(victim)
            free += victim.node_to_gpus
            serving = _serving_after_drain(serving, victim)
            steps += [Step("drain", victim), Step("delete", victim)]
            victim = _next_in_round(remove, add, free, serving, floors)
    for victim in sorted(remove, key=_order):
        steps += [Step("drain", victim), Step("delete", victim)]
    result = Reshuffle(tuple(kept), tuple(steps))
    check_capacity(old, new, result)
    return result


def _raise_stuck(add: list[Instance], remove: list[Instance], free: Counter) -> None:
    """Say which instance cannot be placed and why."""
    first = add[0]
    wanted = ", ".join(f"{g} GPUs on {n} ({free[n]} free)" for n, g in sorted(first.node_to_gpus.items()))
    if not remove:
        raise ReshuffleError(f"{first.role} instance {first.name} needs {wanted}, and no "
                             "old instance is left to make room")
    raise ReshuffleError(f"{first.role} instance {first.name} needs {wanted}; draining "
                         "another old instance first would drop capacity below the smaller "
                         "plan minus one instance")


def serving_counts(old: list[Instance], steps: tuple[Step, ...]) -> list[Counter]:
    """Serving instances per role and in all ("*") after each step, from `old`."""
    serving = Counter({role: sum(1 for i in old if i.role == role) for role in ROLES})
    serving["*"] = len(old)
    after = []
    for step in steps:
        if step.action in ("create", "drain"):
            sign = 1 if step.action == "create" else -1
            serving[step.instance.role] += sign
            serving["*"] += sign
        after.append(Counter(serving))
    return after


def check_capacity(old: list[Instance], new: list[Instance], reshuffle: Reshuffle) -> None:
    """Raise ReshuffleError when a step leaves fewer serving instances than the floor, or
    when the steps do not end at the new set."""
    floors = _floors(old, new)
    for step, serving in zip(reshuffle.steps, serving_counts(old, reshuffle.steps), strict=True):
        if not _is_within(serving, floors):
            raise ReshuffleError(f"{step.action} {step.instance.name} leaves {dict(serving)} "
                                 f"serving, below {floors}")
    created = [s.instance.key for s in reshuffle.steps if s.action == "create"]
    deleted = {s.instance.name for s in reshuffle.steps if s.action == "delete"}
    final = [i.key for i in old if i.name not in deleted] + created
    if Counter(final) != Counter(i.key for i in new):
        raise ReshuffleError("the steps do not end at the new plan's instances")
