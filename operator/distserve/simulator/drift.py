"""A host's speed that moves while it serves, for the simulator to run with.

A latency profile and a correction give each batch one time. A real runner's time for
the same batch moves: from one stretch to the next (on this project's CPU hosts by
x0.95-1.06 per 30 s window against the run's own factor; a decode step's speed by 8% in
sd over 2 s windows, of which the slowdown beside a busy prefill, modelled apart
(`simulator.host`), leaves 7%), and from one batch to the next. A constant speed
predicts one figure where replays of the same requests differ (near the knee by several
points of attainment), and tails too narrow:
TPOT over requests spreads with the speed of the seconds each request decodes in (1P+1D
on SmolLM2, 300 requests at 1.6 req/s simulated with the run's own factors: TPOT p90
0.037 s steady, 0.039 s with decode drifting over 2 s windows, 0.040 s measured; with
the slowdown beside busy instances, 0.038 s steady and 0.039-0.040 s drifting).

`SpeedDrift` says how much the speed moves (what `local.calibration.fit_drift` measures
of a run's iterations) and `SpeedTrack` draws one history of it: each phase's speed
constant over windows of its own length, log-normal across windows with mean 1 (the
correction keeps the mean, the drift only spreads it), and each prefill batch's time
further spread around its window's speed. Decode has no per-step term: a request's TPOT
averages tens to hundreds of steps, and the simulator steps decode batches in closed
form (a decode batch takes the speed of the moment its membership last changed, several
times a second at serving rates). The windows are shared by every instance of a trial:
the host drifts as one.
`DriftingTimer` puts a track under a `StageTimer` for one trial.

A `SpeedHistory` is one run's speed as it was measured, window by window
(`local.calibration.fit_history`), read as it is in place of a drawn track: a
run replayed at its own speed as it moved holds the simulator's policies to the
engine's apart from how well that speed could be foreseen.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from distserve.simulator.timing import InstanceModel, ScaledTimer


@dataclass(frozen=True)
class SpeedDrift:
    """How far a host's speed moves: the standard deviations of log speed."""

    prefill_window_s: float  # prefill's speed holds over windows this long
    prefill_sd: float  # of a window's prefill speed across windows
    decode_window_s: float  # decode's speed holds over windows this long
    decode_sd: float  # of a window's decode speed across windows
    prefill_batch_sd: float = 0.0  # of a prefill batch's time around its window's
    seed: int = 0  # which history a trial draws

    def __post_init__(self) -> None:
        for name in ("prefill_window_s", "decode_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("prefill_sd", "decode_sd", "prefill_batch_sd"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")

    @property
    def is_still(self) -> bool:
        """Whether the speed does not move at all."""
        return self.prefill_sd == self.decode_sd == self.prefill_batch_sd == 0.0

    def describe(self) -> str:
        """e.g. "prefill 2.1% per 30 s window, a batch 6.5%; decode 7.0% per 2 s window"."""
        return (f"prefill {self.prefill_sd:.1%} per {self.prefill_window_s:g} s window, a batch "
                f"{self.prefill_batch_sd:.1%}; decode {self.decode_sd:.1%} per "
                f"{self.decode_window_s:g} s window")

    def histories(self, count: int) -> list[SpeedDrift]:
        """The drift with seeds 0 to count - 1: as many histories of it."""
        return [dataclasses.replace(self, seed=seed) for seed in range(count)]

    def track(self) -> SpeedTrack:
        """The history this drift's seed draws."""
        return SpeedTrack(self)


@dataclass(frozen=True)
class SpeedHistory:
    """The speed one run's runners ran at, window by window from the run's start: each
    phase's multipliers on its modelled time, constant over windows of its own length,
    the last one holding on past the end (`local.calibration.fit_history` measures them).
    A trial run on it replays the run's speed as it moved, where a `SpeedDrift` draws
    histories that move as much: it holds the simulator's policies to the engine's apart
    from how well the speed was foreseen."""

    prefill_window_s: float
    prefill_speeds: tuple[float, ...]
    decode_window_s: float
    decode_speeds: tuple[float, ...]

    def __post_init__(self) -> None:
        for name in ("prefill_window_s", "decode_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("prefill_speeds", "decode_speeds"):
            speeds = getattr(self, name)
            if not speeds or not all(0.0 < v < math.inf for v in speeds):
                raise ValueError(f"{name} must be one or more positive multipliers, got "
                                 f"{speeds!r}")

    @property
    def is_still(self) -> bool:
        """Whether every window runs at the modelled speed."""
        return set(self.prefill_speeds) == set(self.decode_speeds) == {1.0}

    def describe(self) -> str:
        """e.g. "prefill x0.93-1.08 over 12 windows of 10 s, decode x0.85-1.21 over 60 of 2 s"."""
        p, d = self.prefill_speeds, self.decode_speeds
        return (f"prefill x{min(p):.2f}-{max(p):.2f} over {len(p)} window"
                f"{'s' if len(p) > 1 else ''} of {self.prefill_window_s:g} s, decode "
                f"x{min(d):.2f}-{max(d):.2f} over {len(d)} of {self.decode_window_s:g} s")

    def histories(self, count: int) -> list[SpeedHistory]:
        """The one history it is, however many are asked for."""
        return [self]

    def track(self) -> SpeedHistory:
        """Itself: a history is read as measured, in the shape of a `SpeedTrack`."""
        return self

    def prefill_at(self, now_s: float) -> float:
        """The multiplier of the prefill window that holds now_s."""
        return _window_of(self.prefill_speeds, self.prefill_window_s, now_s)

    def decode_at(self, now_s: float) -> float:
        """The multiplier of the decode window that holds now_s."""
        return _window_of(self.decode_speeds, self.decode_window_s, now_s)


class SpeedTrack:
    """One drawn history of a drift: multipliers on iteration times, by simulated time.
    The windows and the batches draw from streams of their own, so that a seed gives
    the same windows whatever batches the trial runs."""

    __slots__ = ("drift", "_prefill", "_decode", "_batch_rng")

    def __init__(self, drift: SpeedDrift) -> None:
        self.drift = drift
        self._prefill = _Windows(drift.prefill_window_s, drift.prefill_sd, [drift.seed, 0])
        self._decode = _Windows(drift.decode_window_s, drift.decode_sd, [drift.seed, 1])
        self._batch_rng = np.random.default_rng([drift.seed, 2])

    def window_at(self, now_s: float) -> tuple[float, float]:
        """(prefill, decode) speed multipliers of the windows that hold now_s."""
        return self._prefill.at(now_s), self._decode.at(now_s)

    def prefill_at(self, now_s: float) -> float:
        """The multiplier on a prefill batch that starts at now_s (drawn afresh per batch)."""
        sd = self.drift.prefill_batch_sd
        batch = _mean_one(sd, self._batch_rng.standard_normal()) if sd else 1.0
        return self._prefill.at(now_s) * batch

    def decode_at(self, now_s: float) -> float:
        """The multiplier on decode steps run from now_s."""
        return self._decode.at(now_s)


def _window_of(speeds: Sequence[float], window_s: float, now_s: float) -> float:
    return speeds[min(len(speeds) - 1, max(0, int(now_s // window_s)))]


class _Windows:
    """One phase's speed per window, drawn as the clock reaches each window."""

    __slots__ = ("window_s", "sd", "_rng", "_offset_s", "_speeds")

    def __init__(self, window_s: float, sd: float, seed: list[int]) -> None:
        self.window_s = window_s
        self.sd = sd
        self._rng = np.random.default_rng(seed)
        # NOTE: the windows start at a random phase: a trial's first arrival is no
        # more the start of a stretch than any other moment
        self._offset_s = float(self._rng.uniform(0.0, window_s))
        self._speeds: list[float] = []

    def at(self, now_s: float) -> float:
        index = max(0, int((now_s + self._offset_s) // self.window_s))
        while len(self._speeds) <= index:
            self._speeds.append(_mean_one(self.sd, self._rng.standard_normal()))
        return self._speeds[index]


def _mean_one(sd: float, z: float) -> float:
    """A log-normal draw with mean 1 and this sd of its log."""
    return math.exp(sd * z - sd * sd / 2) if sd else 1.0


class DriftingTimer(ScaledTimer):
    """A timer whose times follow a `SpeedTrack` (or a `SpeedHistory`) at the trial's
    clock (`loop.now`)."""

    __slots__ = ("track", "loop")

    def __init__(self, timer, track: SpeedTrack | SpeedHistory, loop) -> None:
        super().__init__(timer)
        self.track = track
        self.loop = loop

    def prefill_speed(self) -> float:
        return self.track.prefill_at(self.loop.now)

    def decode_speed(self) -> float:
        return self.track.decode_at(self.loop.now)


def drifting(models: Sequence[InstanceModel], drift: SpeedDrift | SpeedHistory | None,
             loop) -> list[InstanceModel]:
    """One trial's instances, each timed on one track of the drift drawn for the trial,
    or of the history given (the models as they are with neither)."""
    if drift is None or drift.is_still:
        return list(models)
    track = drift.track()
    return [InstanceModel(DriftingTimer(m.timer, track, loop), m.kv_capacity_tokens)
            for m in models]
