"""Discrete-event simulation of LLM serving: DistServe's disaggregated runtime and the
colocated baselines, on one latency model, to predict TTFT, TPOT and SLO attainment.

`simulate_disaggregated` and `simulate_colocated` run one trial over a `Trace`;
`InstanceModel` and `StageTimer` wrap a latency model with the instance's memory;
`SpeedDrift` lets the instances' speed move over a trial as a host's does (a
`SpeedHistory`, as one run's was measured to), and a
`busy_slowdown` slows instances that share a host while the others are busy
(`simulator.host`).
"""

from distserve.simulator.colocated import simulate_colocated
from distserve.simulator.disaggregated import TransferModel, simulate_disaggregated
from distserve.simulator.drift import SpeedDrift, SpeedHistory
from distserve.simulator.results import SLO, SimResult, Trace
from distserve.simulator.timing import InstanceModel, StageTimer

__all__ = [
    "SLO",
    "InstanceModel",
    "SimResult",
    "SpeedDrift",
    "SpeedHistory",
    "StageTimer",
    "Trace",
    "TransferModel",
    "simulate_colocated",
    "simulate_disaggregated",
]
