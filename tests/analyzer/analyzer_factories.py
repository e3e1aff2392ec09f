"""Factories of the analyzer tests: binned lengths as the engine's histograms hold them."""

from __future__ import annotations

import numpy as np

from distserve.analyzer.observation import JointLengths
from distserve_engine.metrics import length_buckets_tokens


def bucket_bounds(max_model_len: int = 2048) -> tuple[float, ...]:
    """The engine's length bucket bounds, +Inf last (as Prometheus answers them)."""
    return (*(float(b) for b in length_buckets_tokens(max_model_len)), float("inf"))


def make_histogram(lengths: np.ndarray, max_model_len: int = 2048) -> tuple[tuple[float, ...], np.ndarray]:
    """Per-bucket counts of integer lengths in the engine's buckets (le: lengths <= bound)."""
    upper = bucket_bounds(max_model_len)
    index = np.searchsorted(np.asarray(upper[:-1]), lengths, side="left")
    return upper, np.bincount(index, minlength=len(upper)).astype(float)



def make_joint(prompts: np.ndarray, outputs: np.ndarray, max_model_len: int = 2048) -> JointLengths:
    """The engine's joint histogram of these (prompt, output) pairs (prompt class x output bucket)."""
    return JointLengths.of_lengths(prompts, outputs, max_model_len)
