"""`distserve up --replan`: the workload analyzer's loop over a local deployment.

Every `intervalSeconds` it observes the last `windowSeconds` of the deployment in
Prometheus (`analyzer/observe.py`: the router's and instances' series, selected by the
deployment's name), calls the same `decide()` the operator calls, and prints one line:
the action, the kind of change, the reason and the numbers. On `replan` it moves its
own processes to the decided plan (`local/reshuffle.py`: new instances first, the old
drained, then stopped) and points Prometheus at the new ones. Prometheus down, slow or
answering garbage is a `no-decision` line, never a stop. The defaults
(`settings.LOCAL_REPLANNING`) are a demo's: windows of a minute, not the operator's 15.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from distserve.analyzer.decide import Decision, DecisionState, PlanEvaluator, decide
from distserve.analyzer.observe import observe
from distserve.analyzer.prometheus import PrometheusClient, PrometheusError
from distserve.analyzer.replan import SearchEvaluator
from distserve.analyzer.settings import ReplanningSpec
from distserve.local.launcher import LocalLauncher
from distserve.local.reshuffle import ReshuffleReport, reshuffle
from distserve.local.settings import LOCAL_REPLANNING, replanned_settings
from distserve.plan import Plan
from distserve.spec import DistServeDeploymentSpec, SpecError


def local_replanning(**overrides: Any) -> ReplanningSpec:
    """The replanning settings of a local run: LOCAL_REPLANNING, then `overrides` (camelCase
    keys; None values ignored)."""
    doc = {**LOCAL_REPLANNING, **{k: v for k, v in overrides.items() if v is not None}}
    return ReplanningSpec.model_validate({"enabled": True, **doc})


def decision_line(decision: Decision) -> str:
    """The printed line: action, kind, reason, then the numbers that were measured."""
    n = decision.numbers
    parts = [f"{n.num_requests} requests", f"{n.observed_rate_rps:.3f} req/s"]
    for label, value in (("observed", n.observed_attainment), ("predicted", n.predicted_attainment),
                         ("new plan", n.new_attainment)):
        if value is not None:
            parts.append(f"{label} {value:.1%}")
    if n.new_gpus is not None:
        parts.append(f"GPUs {n.current_gpus} -> {n.new_gpus}")
    if n.move_s:
        parts.append(f"move {n.move_s:.0f} s")
    if n.held_s is not None:
        parts.append(f"held {n.held_s:.0f} s")
    parts.append(f"correction prefill x{n.prefill_factor:.2f} decode x{n.decode_factor:.2f}")
    return f"decision: {decision.action} {decision.kind or '-'}: {decision.reason} [{'; '.join(parts)}]"


class ReplanLoop:
    """Observe, decide, print and (on replan) reshuffle, one interval at a time."""

    def __init__(self, launcher: LocalLauncher, spec: DistServeDeploymentSpec, plan: Plan,
                 settings: ReplanningSpec, prometheus_url: str,
                 on_targets: Callable[[list[str]], None] | None = None,
                 evaluator: PlanEvaluator | None = None,
                 progress: Callable[[str], None] = print) -> None:
        self.launcher, self.spec, self.plan, self.settings = launcher, spec, plan, settings
        self.client = PrometheusClient(prometheus_url, timeout_s=5.0, retries=1, deadline_s=15.0)
        self.labels = {"deployment": launcher.settings.deployment}
        self.on_targets = on_targets
        self.evaluator = evaluator or SearchEvaluator(spec, max_gpus=settings.max_gpus)
        self.progress = progress
        self.state = DecisionState()
        self.decisions: list[Decision] = []
        self.reshuffles: list[ReshuffleReport] = []

    def step(self) -> Decision | None:
        """One interval: observe the window ending now, decide, print, act. None when
        Prometheus could not answer or the evaluator failed (printed as no decision)."""
        try:
            observation = asyncio.run(observe(self.client, self.labels, self.settings.window_seconds))
        except PrometheusError as err:
            self.progress(f"decision: no-decision -: Prometheus: {err}")
            return None
        try:
            decision = decide(observation, self.plan, self.settings, self.state, self.evaluator)
        except (ValueError, ArithmeticError) as err:
            # NOTE: the search or simulator failing on one window's figures must not stop
            # serving: the window gets no decision, the state is kept for the next one.
            self.progress(f"decision: no-decision -: the evaluator failed on this window: "
                          f"{type(err).__name__}: {err}")
            return None
        self.state = decision.state
        self.decisions.append(decision)
        self.progress(decision_line(decision))
        if decision.action == "replan" and decision.plan is not None:
            self.apply(decision.plan)
        return decision

    def apply(self, plan: Plan) -> ReshuffleReport | None:
        """Move the processes to `plan` (None when this launcher cannot run it)."""
        try:
            settings = replanned_settings(self.launcher.settings, self.spec, plan)
        except SpecError as err:
            self.progress(f"reshuffle: skipped: {err}")
            return None
        self.progress(f"reshuffle: to {plan.prefill.instances} prefill (tp{plan.prefill.tp}"
                      f"pp{plan.prefill.pp}) + {plan.decode.instances} decode (tp{plan.decode.tp}"
                      f"pp{plan.decode.pp}), plan {plan.plan_id}")
        report = reshuffle(self.launcher, settings, self.progress)
        self.plan = plan
        self.reshuffles.append(report)
        if self.on_targets is not None:
            self.on_targets(scrape_targets(self.launcher))
        self.progress(f"reshuffle: done: {report.describe()}")
        return report

    def run(self, stop: threading.Event | None = None) -> None:
        """Step every `intervalSeconds` until `stop` is set (or forever)."""
        stop = stop or threading.Event()
        next_s = time.monotonic() + self.settings.interval_seconds
        while not stop.wait(max(0.0, next_s - time.monotonic())):
            self.step()
            next_s = max(next_s + self.settings.interval_seconds, time.monotonic())


def scrape_targets(launcher: LocalLauncher) -> list[str]:
    """host:port of the router and every instance of the launcher."""
    return [proc.url.removeprefix("http://") for proc in launcher.procs]
