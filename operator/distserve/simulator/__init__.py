"""Discrete-event simulation of LLM serving: DistServe's disaggregated runtime and the
colocated baselines, on one latency model, to predict TTFT, TPOT and SLO attainment.

`simulate_disaggregated` and `simulate_colocated` run one trial over a `Trace`;
`InstanceModel` and `StageTimer` wrap a latency model with the instance's memory.
"""

from distserve.simulator.colocated import simulate_colocated
from distserve.simulator.disaggregated import TransferModel, simulate_disaggregated
from distserve.simulator.results import SLO, SimResult, Trace
from distserve.simulator.timing import InstanceModel, StageTimer

__all__ = [
    "SLO",
    "InstanceModel",
    "SimResult",
    "StageTimer",
    "Trace",
    "TransferModel",
    "simulate_colocated",
    "simulate_disaggregated",
]
