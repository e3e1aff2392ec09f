"""Runners that share one host slow each other down.

A latency profile is measured on a runner alone. Serving, every instance of a local
deployment runs on the same host, each runner on a core of its own, and what they share
(caches, memory bandwidth, the core's sibling thread) makes each slower while another
is busy: on SmolLM2 on a 2-core host, 1 prefill + 1 decode at 1.6 req/s, a decode step
took x0.99 of its profile while the prefill runner was idle and x1.08 while it ran, and
a prefill batch x1.02 while decode was idle and x1.10 while it stepped (`local.
calibration` fits the slowdown from a run's iterations). One factor for a run averages
that over the share of time the others were busy, which grows with the load: a factor
fitted at one rate is too fast at a higher one, and a request decoding while prefill is
idle is faster than one decoding beside it, which spreads TPOT.

`SharedHost` keeps which of a trial's instances are busy; `HostTimer` gives one instance
its times x(1 + slowdown x the share of the other instances busy) at the moment an
iteration (or a decode run, stepped in closed form) starts. When an instance turns busy
or idle, each other instance cuts its decode runs short at their next step, so that
decode follows the others' state step by step; a prefill batch keeps the speed it
started with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from distserve.simulator.timing import InstanceModel, ScaledTimer


def _nothing() -> None:
    return None


def check_slowdown(slowdown: float) -> None:
    """A ValueError unless slowdown is a finite number >= 0."""
    if not 0.0 <= slowdown < float("inf"):
        raise ValueError(f"busy_slowdown must be a number >= 0, got {slowdown}")


class SharedHost:
    """Which instances of one trial are busy, for each to time its iterations by."""

    __slots__ = ("slowdown", "busy", "num_busy", "on_change")

    def __init__(self, slowdown: float, num_instances: int) -> None:
        check_slowdown(slowdown)
        self.slowdown = slowdown
        self.busy = [False] * num_instances
        self.num_busy = 0
        # per instance: called when another instance turns busy or idle
        self.on_change: list[Callable[[], None]] = [_nothing] * num_instances

    def multiplier(self, index: int) -> float:
        """Instance index's time multiplier now: 1 + slowdown x the others' busy share."""
        others = len(self.busy) - 1
        if others <= 0:
            return 1.0
        return 1.0 + self.slowdown * (self.num_busy - self.busy[index]) / others

    def set_busy(self, index: int, is_busy: bool) -> None:
        """Instance index turned busy or idle: the others hear of it."""
        if self.busy[index] == is_busy:
            return
        self.busy[index] = is_busy
        self.num_busy += 1 if is_busy else -1
        for other, notify in enumerate(self.on_change):
            if other != index:
                notify()


def cut_runs(lanes) -> None:
    """Another instance turned busy or idle: each of these stepping lanes (an instance's)
    ends its decode run at its next step, to go on at the host's new speed."""
    for lane in lanes:
        if lane.run.is_stepping:
            lane.run.cut_short()


class HostTimer(ScaledTimer):
    """A timer (`StageTimer` or `DriftingTimer`) whose times follow the host's multiplier
    for one instance at the moment they are asked for."""

    __slots__ = ("host", "index")

    def __init__(self, timer, host: SharedHost, index: int) -> None:
        super().__init__(timer)
        self.host = host
        self.index = index

    def prefill_speed(self) -> float:
        return self.host.multiplier(self.index)

    def decode_speed(self) -> float:
        return self.host.multiplier(self.index)


def shared_host(models: Sequence[InstanceModel], busy_slowdown: float,
                ) -> tuple[list[InstanceModel], SharedHost | None]:
    """One trial's instances on one host that slows each by busy_slowdown while the
    others are busy, with the host to tell of their state (the models as they are, and
    None, with no slowdown or a single instance)."""
    check_slowdown(busy_slowdown)
    if busy_slowdown == 0.0 or len(models) < 2:
        return list(models), None
    host = SharedHost(busy_slowdown, len(models))
    return [InstanceModel(HostTimer(m.timer, host, i), m.kv_capacity_tokens)
            for i, m in enumerate(models)], host
