"""Factories of the decision tests: observations of known traffic, plans, a fake evaluator.

The fake evaluator stands for the planner's search and simulator with a rule a reader
can check by hand: a plan serves `per_gpu_rps` requests per second per GPU when its
shape suits the window's length mix (long prompts want the "long" shape), a third of
that otherwise; attainment is 95% within that capacity and falls in proportion past it.
"""

from __future__ import annotations

import math

import numpy as np
from analyzer_factories import make_histogram

from distserve.analyzer.observation import LengthFit, Observation
from distserve.analyzer.replan import Prediction
from distserve.analyzer.scaling import change_kind
from distserve.latency import Correction
from distserve.plan import PhaseConfig, Plan
from distserve.workload import load_lengths

SHORT_SHAPE = ((2, 2), (2, 2), 1, 1)  # prefill (tp, pp), decode (tp, pp), ratio
LONG_SHAPE = ((2, 4), (4, 2), 2, 1)
LONG_OUTPUT_SHAPE = ((2, 2), (2, 2), 1, 2)


def length_fit(lengths: np.ndarray) -> LengthFit:
    """A log-normal fit from the lengths' log moments, with the engine's binned counts
    (cheap: the decision reads means and counts, never the fit's family)."""
    upper, counts = make_histogram(lengths)
    logs = np.log(np.maximum(lengths, 1))
    sigma, scale = float(logs.std()), float(math.exp(logs.mean()))
    return LengthFit("lognorm", (sigma, 0.0, scale), float(lengths.mean()),
                     float(np.median(lengths)), float(np.percentile(lengths, 90)),
                     upper, tuple(float(c) for c in counts))


def make_observation(
    end_s: float, rate_rps: float = 4.0, dataset: str = "chatbot", window_s: float = 900.0,
    seed: int = 0, num_requests: int | None = None, output_scale: float = 1.0, **fields,
) -> Observation:
    """A window of `dataset` traffic at rate_rps (lengths sampled with `seed`)."""
    num = num_requests if num_requests is not None else int(rate_rps * window_s)
    sample = load_lengths(dataset)
    rng = np.random.default_rng(seed)
    index = rng.integers(0, len(sample), max(num, 1))
    outputs = np.maximum(1, np.rint(sample.output_tokens[index] * output_scale)).astype(np.int64)
    return Observation(
        end_s=end_s, window_s=window_s, num_requests=num, arrival_rate_rps=num / window_s,
        arrival_cv=1.0, prompt=length_fit(sample.prompt_tokens[index]),
        output=length_fit(outputs), **fields,
    )


def make_plan(shape=SHORT_SHAPE, copies: int = 1) -> Plan:
    """A plan of `copies` units of shape (no segments: the fake evaluator needs none)."""
    prefill, decode, n_prefill, n_decode = shape
    return Plan(
        algorithm="low-affinity", model="facebook/opt-66b", accelerator="A100-80GB",
        prefill=PhaseConfig(*prefill, n_prefill * copies),
        decode=PhaseConfig(*decode, n_decode * copies), segments=(), goodput_rps=0.0,
        attainment=0.9, latency=None, ttft_slo_s=2.5, tpot_slo_s=0.15, attainment_target=0.9,
    )


def shape_of(plan: Plan):
    common = math.gcd(plan.prefill.instances, plan.decode.instances)
    return ((plan.prefill.tp, plan.prefill.pp), (plan.decode.tp, plan.decode.pp),
            plan.prefill.instances // common, plan.decode.instances // common)


class FakeEvaluator:
    """The search and simulator by a rule (see the module docstring); records its calls."""

    attainment_target = 0.9

    def __init__(self, per_gpu_rps: float = 0.5, fitted: Correction | None = None,
                 free: int | None = None, dark: tuple[str, ...] = (),
                 loadings: int = 1, on_the_way: float | None = None) -> None:
        self.per_gpu_rps = per_gpu_rps
        self.fitted = fitted
        self.free = free  # GPUs a plan leaves free (None: unknown)
        self.dark = dark  # phases a move to another shape leaves without a serving instance
        self.loadings = loadings  # weight loadings in a row a move to another shape runs
        self.searches = 0
        self.on_the_way = on_the_way  # attainment while a move runs (None: nothing on the way)

    def best_shape(self, observation: Observation):
        if observation.prompt.mean_tokens > 1000:
            return LONG_SHAPE
        return LONG_OUTPUT_SHAPE if observation.output.mean_tokens > 400 else SHORT_SHAPE

    def capacity_rps(self, plan: Plan, observation: Observation) -> float:
        suits = shape_of(plan) == self.best_shape(observation)
        return plan.num_gpus * self.per_gpu_rps * (1.0 if suits else 1 / 3)

    def predict(self, plan, observation, rate_rps, correction) -> Prediction:
        capacity = self.capacity_rps(plan, observation)
        attainment = 0.95 if capacity >= rate_rps else 0.95 * capacity / rate_rps
        return Prediction(rate_rps, attainment, 1.0, 0.05)

    def replay(self, plan, observation, correction) -> Prediction:
        return self.predict(plan, observation, observation.arrival_rate_rps, correction)

    def fit_correction(self, plan, observation) -> Correction | None:
        return self.fitted

    def _sized(self, shape, observation, rate_rps) -> Plan:
        one = make_plan(shape)
        copies = max(1, math.ceil(rate_rps / self.capacity_rps(one, observation)))
        return make_plan(shape, copies)

    def search(self, observation, rate_rps, correction, beside=None) -> Plan | None:
        self.searches += 1
        return self._sized(self.best_shape(observation), observation, rate_rps)

    def scale(self, plan, observation, rate_rps, correction) -> Plan | None:
        return self._sized(shape_of(plan), observation, rate_rps)

    def dark_phases(self, current, new) -> tuple[str, ...]:
        return self.dark if change_kind(current, new) != "replicas" else ()

    def move_attainment(self, current, new, observation, rate_rps, correction) -> float | None:
        return self.on_the_way

    def free_gpus(self, plan) -> int | None:
        return self.free

    def reshuffle_loadings(self, current, new) -> int:
        return self.loadings if change_kind(current, new) != "replicas" else 1
