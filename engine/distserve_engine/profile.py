"""The hardware profiler: times the real runner and fits the planner's latency formulas.

It runs prefill batches over a grid of prompt lengths and batch compositions, and
decode steps over batch sizes and context lengths, on a `ModelRunner` on this device,
and fits (milliseconds, as in the DistServe authors' profile files):

    prefill_ms = a + b*S1 + c*S2     S1 = sum of prompt lengths, S2 = sum of their squares
    decode_ms  = a + b*T + c*B       T = sum of (context + 1) over the batch, B = batch size

with one decode fit below `large_batch_from` and one from it on. Coefficients are kept
non-negative (a negative term would predict negative time outside the grid) and fit
by relative error, so short batches count as much as long ones. Points are timed in
interleaved rounds and the median kept, since other processes may share the cores.
Decode timings use synthetic contexts: the KV blocks are reserved but not filled, since
attention costs the same whatever the cached values are. The control plane turns `HardwareProfile`
into a profile file; this module never imports it.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from distserve_engine.config import EngineConfig
from distserve_engine.runner import ModelRunner
from distserve_engine.sampling import SamplingParams
from distserve_engine.sequence import Sequence as EngineSequence

GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
# A decode split is kept only when it cuts the squared relative error by this share.
SPLIT_MIN_GAIN = 0.2
# Fast points (a tiny model) are repeated up to this many times to reach min_point_s.
MAX_REPEATS = 50
# The profile format's prefill formula is (a + b*S1 + c*S2) / pp + pp: at pp = 1 it adds
# 1 ms, so the fitted a is written 1 ms lower for the planner to reproduce the timings.
FORMAT_PREFILL_PP1_MS = 1.0
ABC = tuple[float, float, float]


@dataclass(frozen=True)
class ProfileGrid:
    """What to time. Prefill batches are lists of prompt lengths; decode points are
    (batch size, context length) pairs, every sequence of a batch at that context."""

    prefill_batches: tuple[tuple[int, ...], ...]
    decode_batch_sizes: tuple[int, ...]
    decode_context_lens: tuple[int, ...]
    warmup: int = 1  # untimed runs of each point (the first run of a shape is slower)
    repeats: int = 3  # timed runs of each point at least; the median is kept
    min_point_s: float = 0.05  # ... and more, up to MAX_REPEATS, until a point took this long

    @classmethod
    def default(cls, max_prefill_tokens: int = 512, max_decode_batch: int = 32,
                max_context_len: int = 512, repeats: int = 3) -> ProfileGrid:
        """Powers of two up to the given bounds, a prompt length between each two of them
        (`_between_powers`), plus batches of 2-8 equal prompts that fill
        max_prefill_tokens (they separate the S1 and S2 terms); decode batch sizes
        also at three times each power of two (3, 6, 12, ...): on the CPU a linear of 3
        rows or more runs another weight layout than one of 1-2 rows, and a decode fit
        whose small side saw only batches of 1 and 2 put a batch of 3 ~40% high."""
        lens = _powers_of_two(16, max_prefill_tokens)
        singles = [(n,) for n in sorted(lens + _between_powers(lens))]
        filled = [(n,) * (max_prefill_tokens // n) for n in lens if 2 <= max_prefill_tokens // n <= 8]
        contexts = _powers_of_two(64, max_context_len)
        return cls(
            prefill_batches=tuple(singles + filled),
            decode_batch_sizes=tuple(sorted(set(_powers_of_two(1, max_decode_batch)) | {
                3 * n for n in _powers_of_two(1, max_decode_batch // 3) if n})),
            decode_context_lens=tuple(sorted({contexts[0], contexts[len(contexts) // 2], contexts[-1]})),
            repeats=repeats,
        )


@dataclass(frozen=True)
class Timing:
    """One measured point: the formula's inputs and the median time."""

    x1: int  # S1 (prefill) or T (decode)
    x2: int  # S2 (prefill) or B (decode)
    ms: float  # median over the repeats
    label: str  # e.g. "prefill 4x128" or "decode B=8 ctx=256"


@dataclass(frozen=True)
class FitError:
    """How far a fit is from the timings it was fitted to (relative to the measured time)."""

    mean_rel: float
    max_rel: float


@dataclass
class HardwareProfile:
    """The fitted coefficients (ms), the measurements behind them and the KV capacity."""

    prefill_abc: ABC
    decode_small_batch_abc: ABC
    decode_large_batch_abc: ABC
    large_batch_from: int
    kv_capacity_tokens: int
    prefill_error: FitError
    decode_error: FitError
    device: str
    threads: int
    seconds: float  # wall time the profiling took
    prefill_timings: list[Timing] = field(default_factory=list)
    decode_timings: list[Timing] = field(default_factory=list)

    def fit_entry(self) -> dict:
        """The per-(model, tp) entry of a profile file (the a100-opt-profile.json shape)."""
        a, b, c = self.prefill_abc
        return {
            "prefill_abc": [a - FORMAT_PREFILL_PP1_MS, b, c],
            "decode_small_batch_abc": list(self.decode_small_batch_abc),
            "decode_large_batch_abc": list(self.decode_large_batch_abc),
            "large_batch_from": self.large_batch_from,
        }

    def prefill_ms(self, prompt_lens: Sequence[int]) -> float:
        """The fitted time of a prefill batch."""
        return _eval(self.prefill_abc, sum(prompt_lens), sum(n * n for n in prompt_lens))

    def decode_ms(self, context_lens: Sequence[int]) -> float:
        """The fitted time of a decode step; lengths include the new token."""
        small = len(context_lens) < self.large_batch_from
        abc = self.decode_small_batch_abc if small else self.decode_large_batch_abc
        return _eval(abc, sum(context_lens), len(context_lens))


def profile_runner(runner: ModelRunner, grid: ProfileGrid,
                   progress: Callable[[str], None] | None = None) -> HardwareProfile:
    """Time the grid on this runner and fit the formulas."""
    started = time.perf_counter()
    say = progress or (lambda _message: None)
    blocks = runner.block_manager
    prefill_points = [b for b in grid.prefill_batches
                      if max(b) <= runner.max_model_len and runner.can_allocate(sum(b))]
    decode_points = [
        (batch_size, context_len)
        for batch_size, context_len in itertools.product(grid.decode_batch_sizes, grid.decode_context_lens)
        if context_len <= runner.max_model_len
        and batch_size * blocks.num_blocks_for(context_len) <= blocks.num_free_blocks
    ]
    if len(prefill_points) < 3 or len(decode_points) < 3:
        raise ValueError("the grid leaves fewer than 3 prefill or decode points that fit this "
                         "runner's context and KV cache: widen it or raise the KV budget")
    point_to_run = {("prefill", b): functools.partial(time_prefill, runner, b) for b in prefill_points}
    point_to_run |= {("decode", p): functools.partial(time_decode, runner, *p) for p in decode_points}
    say(f"timing {len(prefill_points)} prefill batches and {len(decode_points)} decode points "
        f"(a warm-up round, then at least {grid.repeats} timed rounds)")
    point_to_ms = _median_ms_interleaved(point_to_run, grid, say)
    prefill = [Timing(sum(b), sum(n * n for n in b), point_to_ms[("prefill", b)], _prefill_label(b))
               for b in prefill_points]
    decode = [Timing(bs * ctx, bs, point_to_ms[("decode", (bs, ctx))], f"decode B={bs} ctx={ctx}")
              for bs, ctx in decode_points]
    prefill_abc = fit_abc(prefill)
    small_abc, large_abc, large_from = fit_decode(decode)
    result = HardwareProfile(
        prefill_abc=prefill_abc, decode_small_batch_abc=small_abc,
        decode_large_batch_abc=large_abc, large_batch_from=large_from,
        kv_capacity_tokens=runner.num_blocks * runner.config.block_size,
        prefill_error=FitError(0.0, 0.0), decode_error=FitError(0.0, 0.0),
        device=str(runner.device), threads=torch.get_num_threads(),
        seconds=time.perf_counter() - started, prefill_timings=prefill, decode_timings=decode,
    )
    result.prefill_error = fit_error(prefill, lambda t: _eval(prefill_abc, t.x1, t.x2))
    result.decode_error = fit_error(decode, lambda t: result.decode_ms([t.x1 / t.x2] * t.x2))
    return result


def profile_model(config: EngineConfig, grid: ProfileGrid | None = None, threads: int | None = None,
                  progress: Callable[[str], None] | None = None) -> HardwareProfile:
    """Load the model on config.device and profile it (on CPU with `threads` threads,
    torch's thread count restored afterwards)."""
    previous_threads = torch.get_num_threads()
    if config.device_type == "cpu" and threads:
        torch.set_num_threads(threads)
    try:
        if progress:
            progress(f"loading {config.model} on {config.device_type}")
        runner = ModelRunner(config)
        if grid is None:
            grid = ProfileGrid.default(max_context_len=min(512, runner.max_model_len // 2))
        return profile_runner(runner, grid, progress)
    finally:
        torch.set_num_threads(previous_threads)


def fit_abc(timings: Sequence[Timing]) -> ABC:
    """Non-negative (a, b, c) minimising the squared relative error of a + b*x1 + c*x2."""
    x = np.array([[1.0, t.x1, t.x2] for t in timings])
    y = np.array([t.ms for t in timings])
    weights = 1.0 / y  # relative error: every row scaled by its own time
    best, best_loss = np.zeros(3), float("inf")
    # NOTE: exact non-negative least squares for 3 unknowns: the optimum is the
    # unconstrained fit over some subset of the terms, so try all 7 subsets.
    for size in (1, 2, 3):
        for cols in itertools.combinations(range(3), size):
            sub = x[:, cols] * weights[:, None]
            coef, *_ = np.linalg.lstsq(sub, y * weights, rcond=None)
            if (coef < 0).any():
                continue
            loss = float(np.sum((sub @ coef - y * weights) ** 2))
            if loss < best_loss:
                best, best_loss = np.zeros(3), loss
                best[list(cols)] = coef
    return (float(best[0]), float(best[1]), float(best[2]))


def fit_decode(timings: Sequence[Timing]) -> tuple[ABC, ABC, int]:
    """(small-batch fit, large-batch fit, large_batch_from): one split by batch size
    when it fits clearly better than a single line, else the same fit on both sides."""
    single = fit_abc(timings)
    largest = max(t.x2 for t in timings)
    best = (single, single, largest + 1)
    best_loss = _rel_loss(timings, lambda t: _eval(single, t.x1, t.x2))
    if best_loss < 1e-12:  # one line already fits to rounding error
        return best
    threshold = best_loss * (1 - SPLIT_MIN_GAIN)
    for split in sorted({t.x2 for t in timings}):
        small = [t for t in timings if t.x2 < split]
        large = [t for t in timings if t.x2 >= split]
        if len({t.x2 for t in small}) < 2 or len({t.x2 for t in large}) < 2:
            continue
        small_abc, large_abc = fit_abc(small), fit_abc(large)
        loss = (_rel_loss(small, lambda t, abc=small_abc: _eval(abc, t.x1, t.x2))
                + _rel_loss(large, lambda t, abc=large_abc: _eval(abc, t.x1, t.x2)))
        if loss < threshold:
            best, threshold = (small_abc, large_abc, split), loss
    return best


def fit_error(timings: Sequence[Timing], predict: Callable[[Timing], float]) -> FitError:
    """Mean and worst relative error of predict against the timings."""
    errors = [abs(predict(t) - t.ms) / t.ms for t in timings]
    return FitError(statistics.fmean(errors), max(errors))


def time_prefill(runner: ModelRunner, prompt_lens: tuple[int, ...]) -> float:
    """Milliseconds of one prefill batch of these prompt lengths."""
    vocab = runner.model_config.vocab_size
    seqs = [EngineSequence(seq_id=i, prompt_token_ids=[(7 * j + i) % vocab for j in range(n)],
                           params=GREEDY)
            for i, n in enumerate(prompt_lens)]
    try:
        return _timed(runner, lambda: runner.prefill(seqs))
    finally:
        for seq in seqs:
            runner.free(seq)


def time_decode(runner: ModelRunner, batch_size: int, context_len: int) -> float:
    """Milliseconds of one decode step of batch_size sequences of context_len tokens each
    (context_len - 1 cached, plus the new one): T = batch_size * context_len."""
    vocab = runner.model_config.vocab_size
    seqs = [EngineSequence(seq_id=i, prompt_token_ids=[(5 * j + i) % vocab for j in range(context_len)],
                           params=GREEDY)
            for i in range(batch_size)]
    # Synthetic contexts: the blocks are reserved and taken as cached, never filled.
    runner.block_manager.reserve(seqs, [context_len] * batch_size)
    for seq in seqs:
        seq.num_cached_tokens = context_len - 1
    try:
        return _timed(runner, lambda: runner.decode(seqs))
    finally:
        for seq in seqs:
            runner.free(seq)


def _median_ms_interleaved(point_to_run: dict, grid: ProfileGrid,
                           say: Callable[[str], None]) -> dict:
    """Each point's median time. After grid.warmup untimed runs of every point, the points
    are timed in rounds, one run each, so that a burst of load from other processes
    spreads over all points instead of skewing a few neighbours; a point takes part in
    rounds until it has grid.repeats runs and they add up to grid.min_point_s (a tiny
    model's fast points run more, at most MAX_REPEATS). One progress line per round."""
    started = time.perf_counter()
    for run in point_to_run.values():
        for _ in range(grid.warmup):
            run()
    say(f"warm-up round done ({time.perf_counter() - started:.0f} s)")
    point_to_times: dict = {point: [] for point in point_to_run}

    def needs_more(times: list[float]) -> bool:
        return len(times) < grid.repeats or (
            sum(times) < grid.min_point_s * 1e3 and len(times) < MAX_REPEATS)

    num_rounds = 0
    while pending := [p for p, times in point_to_times.items() if needs_more(times)]:
        for point in pending:
            point_to_times[point].append(point_to_run[point]())
        num_rounds += 1
        if num_rounds <= grid.repeats:  # later rounds re-time only fast points, briefly
            say(f"timed round {num_rounds} of {grid.repeats} ({len(pending)} points, "
                f"{time.perf_counter() - started:.0f} s)")
    return {point: statistics.median(times) for point, times in point_to_times.items()}


def _prefill_label(prompt_lens: tuple[int, ...]) -> str:
    if len(set(prompt_lens)) == 1:
        return f"prefill {len(prompt_lens)}x{prompt_lens[0]}"
    return "prefill " + "+".join(map(str, prompt_lens))


def _timed(runner: ModelRunner, call: Callable[[], object]) -> float:
    """Milliseconds call takes, with the device synchronised on both sides."""
    is_cuda = runner.device.type == "cuda"
    if is_cuda:
        torch.cuda.synchronize(runner.device)
    started = time.perf_counter()
    call()
    if is_cuda:
        torch.cuda.synchronize(runner.device)
    return (time.perf_counter() - started) * 1e3


def _eval(abc: ABC, x1: float, x2: float) -> float:
    return abc[0] + abc[1] * x1 + abc[2] * x2


def _rel_loss(timings: Sequence[Timing], predict: Callable[[Timing], float]) -> float:
    return sum(((predict(t) - t.ms) / t.ms) ** 2 for t in timings)


def _between_powers(powers: Sequence[int]) -> list[int]:
    """A length between each two powers of two n and 2n (`powers` as `_powers_of_two`
    gives them): 3n/2 - 7, odd as prompts are.
    Powers of two run fastest: on the CPU in bfloat16 a prefill of 89 tokens took 144 ms
    where 128 took 171, and prompts of random lengths from 64 to 512 took ~6% more than
    a fit of powers of two alone gave them. With these the fit is of prompts as they come."""
    return [3 * n // 2 - 7 for n in powers[:-1]]


def _powers_of_two(low: int, high: int) -> list[int]:
    values, n = [], low
    while n <= high:
        values.append(n)
        n *= 2
    return values or [high]
