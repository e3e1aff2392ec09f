"""Growing a deployment until its simulated goodput reaches the target rate: the one loop
behind Algorithm 1's instance counts and Algorithm 2's copies of units.

Goodputs summed over instances (or copies) only estimate what they serve together, so
each size is simulated whole, and the next is that size scaled by how far its goodput
fell short (rate / goodput). The loop stops at the first size that serves the rate, when
no rate meets the SLOs, when scaling gives no new size (nothing more fits), or after
max_sizes simulations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from distserve.search.goodput import Goodput

Size = TypeVar("Size")


def grow_to_rate(
    first: Size | None, simulate: Callable[[Size], Goodput],
    scaled: Callable[[Size, float], Size | None], rate_rps: float | None, max_sizes: int,
) -> list[tuple[Size, Goodput]]:
    """Every size simulated, in order, with its goodput (the last is where it stopped);
    without a rate, first alone."""
    tried: list[tuple[Size, Goodput]] = []
    size = first
    while size is not None and len(tried) < max_sizes and all(size != s for s, _ in tried):
        goodput = simulate(size)
        tried.append((size, goodput))
        if not rate_rps or goodput.rate_rps >= rate_rps or goodput.rate_rps <= 0:
            break
        size = scaled(size, rate_rps / goodput.rate_rps)
    return tried
