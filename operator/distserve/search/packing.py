"""Which unit shapes, and how many copies of each, a plan deploys on the cluster.

A unit's goodput per GPU says little about a cluster of fixed nodes: a unit taking 6
GPUs on each of its nodes strands 2 of every 8, and its copies run out of nodes before
the cluster runs out of GPUs. So the choice is made on what the copies that fit serve
together (each copy's goodput times the copies): for a target rate, the fewest GPUs
whose copies reach it, else the most the cluster holds; with no target, the most the
cluster holds (its capacity). The GPUs a shape leaves free are filled with copies of
a second shape (a mixed plan). Copies are counted by placing them (`placement`), within
the GPU budget. The sums are estimates: `replicas` simulates the chosen copies together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distserve.search.algorithms import UnitChoice
from distserve.search.placement import Shape, copies_that_fit

MAX_FEWER_COPIES = 2  # a smaller mix has at most this many fewer copies of the first shape
# Mixes estimated this close below the rate are tried too: the ratio that scales the
# estimates comes from one bisection, itself only within REL_TOL (3%) of the answer
FEWER_SLACK = 0.02


@dataclass(frozen=True)
class Mix:
    """Copies of one unit shape, or of two (the second filling the GPUs the first left)."""

    shapes: tuple[tuple[UnitChoice, int], ...]  # (shape, copies), in the order placed

    @property
    def estimate_rps(self) -> float:
        """Copies times each copy's own goodput (an overestimate of them together)."""
        return sum(copies * choice.goodput.rate_rps for choice, copies in self.shapes)

    @property
    def num_gpus(self) -> int:
        """GPUs all copies take."""
        return sum(copies * choice.unit.num_gpus for choice, copies in self.shapes)

    @property
    def is_single_unit(self) -> bool:
        """One copy of one shape: its goodput is the unit's own, already simulated."""
        return len(self.shapes) == 1 and self.shapes[0][1] == 1

    def placed(self) -> list[Shape]:
        """What `placement.place_shapes` takes."""
        return [(choice.unit, choice.inter_op, copies) for choice, copies in self.shapes]

    def describe(self) -> str:
        """e.g. "8 x 24-GPU unit (prefill tp1pp8 x1, decode tp4pp4 x1) + 4 x 16-GPU unit
        (...)": two shapes may take as many GPUs."""
        return " + ".join(
            f"{copies} x {c.unit.num_gpus}-GPU unit (prefill tp{c.unit.prefill.tp}"
            f"pp{c.unit.prefill.pp} x{c.unit.n_prefill}, decode tp{c.unit.decode.tp}"
            f"pp{c.unit.decode.pp} x{c.unit.n_decode})"
            for c, copies in self.shapes
        )


@dataclass(frozen=True)
class Room:
    """Where copies may go: the nodes and the GPU budget."""

    node_names: list[str]
    gpus_per_node: int
    max_gpus: int

    def fit(self, placed: list[Shape], choice: UnitChoice, limit: int) -> int:
        """Copies of choice (at most limit) that fit beside placed, within the budget."""
        used = sum(unit.num_gpus * copies for unit, _, copies in placed)
        limit = min(limit, (self.max_gpus - used) // choice.unit.num_gpus)
        if limit <= 0:
            return 0
        return copies_that_fit(self.node_names, self.gpus_per_node, placed, choice.unit,
                               choice.inter_op, limit)


def choose_mix(choices: list[UnitChoice], room: Room, rate_rps: float | None) -> Mix | None:
    """The fewest-GPU mix estimated to serve rate_rps, else (or with no rate) the mix
    of the highest estimated goodput; None when no copy of any shape fits."""
    mixes = [mix for main in choices if main.goodput.rate_rps > 0
             for mix in _mixes_with(main, choices, room, rate_rps)]
    if not mixes:
        return None
    if rate_rps:
        serving = [mix for mix in mixes if mix.estimate_rps >= rate_rps]
        if serving:
            return min(serving, key=lambda mix: (mix.num_gpus, -mix.estimate_rps))
    return max(mixes, key=lambda mix: (mix.estimate_rps, -mix.num_gpus))


def _mixes_with(
    main: UnitChoice, choices: list[UnitChoice], room: Room, rate_rps: float | None
) -> list[Mix]:
    """Copies of main (as many as the rate needs, one fewer, or all that fit), each
    alone and with every other shape filling what they leave free."""
    most = room.fit([], main, room.max_gpus)
    if most == 0:
        return []
    need = math.ceil(rate_rps / main.goodput.rate_rps) if rate_rps else most
    counts = sorted({min(need, most), min(need, most) - 1} - {0})
    mixes = []
    for count in counts:
        mixes.append(Mix(((main, count),)))
        if rate_rps and count >= need:
            continue  # main alone is estimated to serve the rate
        placed = [(main.unit, main.inter_op, count)]
        left_rps = (rate_rps - count * main.goodput.rate_rps) if rate_rps else None
        for fill in choices:
            if fill is main or fill.goodput.rate_rps <= 0:
                continue
            wanted = math.ceil(left_rps / fill.goodput.rate_rps) if left_rps else room.max_gpus
            copies = room.fit(placed, fill, wanted)
            if copies:
                mixes.append(Mix(((main, count), (fill, copies))))
    return mixes


def fewer_gpu_mixes(choices: list[UnitChoice], room: Room, rate_rps: float, serving: Mix,
                    ratio: float) -> list[Mix]:
    """Mixes on fewer GPUs than serving that may still serve rate_rps, fewest GPUs first,
    then the highest estimate: as many copies of its first shape or up to
    MAX_FEWER_COPIES fewer, alone or with the fewest copies of another shape that bring
    the estimate, scaled by ratio (what serving's simulation found of its estimate), to
    the rate, less FEWER_SLACK."""
    main, count = serving.shapes[0]
    wanted_rps = rate_rps * (1 - FEWER_SLACK) / ratio
    mixes: set[Mix] = set()
    for fewer in range(max(1, count - MAX_FEWER_COPIES), count + 1):
        left_rps = wanted_rps - fewer * main.goodput.rate_rps
        if left_rps <= 0:
            mixes.add(Mix(((main, fewer),)))
            continue
        placed = [(main.unit, main.inter_op, fewer)]
        for fill in choices:
            if fill is main or fill.goodput.rate_rps <= 0:
                continue
            copies = math.ceil(left_rps / fill.goodput.rate_rps)
            if room.fit(placed, fill, copies) == copies:
                mixes.add(Mix(((main, fewer), (fill, copies))))
    smaller = [mix for mix in mixes if mix.num_gpus < serving.num_gpus]
    return sorted(smaller, key=lambda mix: (mix.num_gpus, -mix.estimate_rps))
