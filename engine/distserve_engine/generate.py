"""Offline generation: prefill a list of prompts together, then decode until all stop.

No scheduling beyond that; the serving runtime's instance loops do the real batching.
Used by tests, benchmarks and quick experiments.
"""

from __future__ import annotations

from distserve_engine.runner import ModelRunner
from distserve_engine.sampling import SamplingParams
from distserve_engine.sequence import Sequence


def generate(runner: ModelRunner, prompts: list[list[int]], params: SamplingParams,
             seq_id_start: int = 0) -> list[Sequence]:
    """Generate for every prompt (token ids) in one batch; return the finished sequences."""
    seqs = [Sequence(seq_id_start + i, list(p), params) for i, p in enumerate(prompts)]
    runner.prefill(seqs)
    running = _still_running(runner, seqs)
    while running:
        runner.decode(running)
        running = _still_running(runner, running)
    return seqs


def _still_running(runner: ModelRunner, seqs: list[Sequence]) -> list[Sequence]:
    running = []
    for seq in seqs:
        runner.check_stop(seq)
        if seq.is_finished:
            runner.free(seq)
        else:
            running.append(seq)
    return running
