"""The workload analyzer: observes traffic in Prometheus and decides when to replan.

`observation.py` is the contract: what one window of traffic looked like. Observing
(Prometheus -> Observation) and deciding (Observation, plan, spec -> keep or replan)
are separate, so the decision is a pure function the operator, `distserve up --replan`
and the replanning benchmark share.
"""
