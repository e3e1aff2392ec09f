"""Workloads: request lengths from real datasets, arrival processes and trace replay.

`make_workload` builds what a spec's `workload` section describes; its `sample` gives
the simulator the requests for one rate.
"""

from distserve.workload.arrivals import gamma_arrivals, poisson_arrivals, scaled_trace_arrivals
from distserve.workload.lengths import DATASETS, LengthSample, load_lengths
from distserve.workload.sampling import ARRIVALS, Workload, make_workload
from distserve.workload.trace import Request, TraceError, load_trace

__all__ = [
    "ARRIVALS",
    "DATASETS",
    "LengthSample",
    "Request",
    "TraceError",
    "Workload",
    "gamma_arrivals",
    "load_lengths",
    "load_trace",
    "make_workload",
    "poisson_arrivals",
    "scaled_trace_arrivals",
]
