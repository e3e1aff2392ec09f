"""The search and simulator on observed traffic: the latency correction, its fit, the
resampled workload, replica scaling, and a search whose shape follows the length mix."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from analyzer_factories import make_histogram, make_joint
from decision_factories import SHORT_SHAPE, make_observation, make_plan

from distserve.analyzer.fit import fit_lengths
from distserve.analyzer.observation import Observation
from distserve.analyzer.observe import dispersion_cv
from distserve.analyzer.replan import NUM_SAMPLES, Prediction, SearchEvaluator, observed_workload
from distserve.analyzer.scaling import change_kind, copy_unit, place_copies, started_gpus
from distserve.latency import Correction, corrected, get_latency_model
from distserve.search.trials import simulate_unit
from distserve.simulator import Trace
from distserve.spec import parse_spec
from distserve.workload import load_lengths

OPT_66B = {
    "model": {"name": "facebook/opt-66b"},
    "slo": {"ttftSeconds": 2.5, "tpotSeconds": 0.15, "attainment": 0.9},
    "cluster": {"nodes": 4, "gpusPerNode": 8, "accelerator": "A100-80GB",
                "nodeAffinity": "low", "interNodeBandwidthGbps": 25},
    "planner": {"numRequests": 200, "workers": 1, "maxNodesPerInstance": 1},
}


def make_evaluator() -> SearchEvaluator:
    return SearchEvaluator(parse_spec(OPT_66B))


def placed_plan(evaluator: SearchEvaluator, shape=SHORT_SHAPE, copies: int = 1):
    plan = make_plan(shape)
    unit = copy_unit(plan, 1.0)
    return place_copies(plan, unit, copies, evaluator.node_names, evaluator.gpus_per_node)


def test_correction_scales_each_phase_and_leaves_hand_offs():
    base = get_latency_model("facebook/opt-66b", "A100-80GB", 2, 2)
    scaled = corrected(base, Correction(1.5, 0.5))
    assert scaled.prefill_stage_s([512]) == pytest.approx(1.5 * base.prefill_stage_s([512]))
    assert scaled.decode_stage_s([300] * 8) == pytest.approx(0.5 * base.decode_stage_s([300] * 8))
    assert scaled.stage_handoff_s(512) == base.stage_handoff_s(512)
    assert corrected(base, Correction()) is base
    with pytest.raises(ValueError, match="prefill_factor"):
        Correction(10.0, 1.0)


def test_a_time_per_sequence_adds_to_each_decode_step_once_over_its_stages():
    base = get_latency_model("facebook/opt-66b", "A100-80GB", 2, 2)  # pp 2
    scaled = corrected(base, Correction(1.0, 0.5, decode_sequence_s=0.002))
    steps = {n: scaled.decode_stage_s([300] * n) - 0.5 * base.decode_stage_s([300] * n)
             for n in (1, 8)}
    assert steps == pytest.approx({1: 0.001, 8: 0.008})  # per stage: half of 2 ms a sequence
    assert scaled.prefill_stage_s([512]) == pytest.approx(base.prefill_stage_s([512]))
    with pytest.raises(ValueError, match="decode_sequence_s"):
        Correction(1.0, 1.0, decode_sequence_s=-0.001)
    assert Correction.clamped(1.0, 1.0, 5.0).decode_sequence_s == 0.1
    assert not Correction(decode_sequence_s=0.001).is_identity


def test_the_fit_recovers_known_latency_factors():
    evaluator = make_evaluator()
    plan = placed_plan(evaluator)
    window = make_observation(900, 3.0, "chatbot")
    truth = evaluator.predict(plan, window, 3.0, Correction(1.3, 0.8))
    measured = make_observation(900, 3.0, "chatbot", ttft_p90_s=truth.ttft_p90_s,
                                tpot_p90_s=truth.tpot_p90_s)
    fitted = evaluator.fit_correction(plan, measured)
    assert fitted.prefill_factor == pytest.approx(1.3, rel=0.08)
    assert fitted.decode_factor == pytest.approx(0.8, rel=0.08)
    assert evaluator.fit_correction(plan, window) is None  # no measured latencies


def test_the_fit_takes_the_root_near_one_where_the_p90_dips():
    # a simulated p90 that is above the served 0.66 s below x0.75 (faster prefill, more
    # KV held waiting for decode), dips under it, and crosses it again at x0.985: a
    # bisection of the whole bracket, starting at x1.0, runs down to x0.5
    def p90(factor: float) -> float:
        return 0.67 * factor + (0.3 if factor < 0.75 else 0.0)

    assert SearchEvaluator._fit_factor(p90, 0.66) == pytest.approx(0.985, rel=0.02)
    # served far off: the wide bracket still finds it
    assert SearchEvaluator._fit_factor(lambda f: 0.5 * f, 0.8) == pytest.approx(1.6, rel=0.03)


def test_the_fit_replays_a_window_whose_rate_climbs_as_it_came():
    # chatbot traffic climbing from 1 to 4 req/s over 15 minutes (Poisson at each moment),
    # served with a true latency of the model x (1.3 prefill, 0.8 decode)
    evaluator = make_evaluator()
    plan = placed_plan(evaluator)
    rng = np.random.default_rng(3)
    counts = rng.poisson(np.linspace(1.0, 4.0, 30) * 30.0)
    arrivals = np.sort(np.concatenate([(k + rng.random(c)) * 30.0 for k, c in enumerate(counts)]))
    sample = load_lengths("chatbot")
    pick = rng.integers(0, len(sample), len(arrivals))
    prompts, outputs = sample.prompt_tokens[pick], sample.output_tokens[pick]
    window = Observation(
        end_s=900.0, window_s=900.0, num_requests=len(arrivals),
        arrival_rate_rps=len(arrivals) / 900.0, arrival_cv=dispersion_cv(counts),
        prompt=fit_lengths(*make_histogram(prompts)), output=fit_lengths(*make_histogram(outputs)),
        joint=make_joint(prompts, outputs), arrival_counts=tuple(float(c) for c in counts),
        subwindow_s=30.0)
    truth = evaluator.context(window, Correction(1.3, 0.8))
    served = simulate_unit(truth, evaluator.unit_of(truth, plan), Trace(arrivals, prompts, outputs))
    measured = replace(window, ttft_p90_s=served.percentile_s("ttft", 90),
                       tpot_p90_s=served.percentile_s("tpot", 90))
    fitted = evaluator.fit_correction(plan, measured)
    assert fitted.prefill_factor == pytest.approx(1.3, rel=0.08)
    assert fitted.decode_factor == pytest.approx(0.8, rel=0.08)
    # replayed at the window's mean rate instead, as arrivals of the counts' plain
    # dispersion (the climb read as CV ~3.6), the queue it predicts is far longer
    plain_cv = float(np.sqrt(counts.var(ddof=1) / counts.mean()))
    flat = evaluator.predict(plan, replace(window, arrival_cv=plain_cv),
                             window.arrival_rate_rps, Correction(1.3, 0.8))
    replayed = evaluator.replay(plan, window, Correction(1.3, 0.8))
    print(f"TTFT p90: served {measured.ttft_p90_s:.2f} s, replayed {replayed.ttft_p90_s:.2f} s, "
          f"at the mean rate with CV {plain_cv:.1f} {flat.ttft_p90_s:.2f} s; the fit "
          f"x{fitted.prefill_factor:.2f} prefill, x{fitted.decode_factor:.2f} decode")
    assert replayed.ttft_p90_s == pytest.approx(measured.ttft_p90_s, rel=0.15)
    assert flat.ttft_p90_s > 2 * measured.ttft_p90_s


def test_the_observed_workload_stays_inside_the_context():
    window = make_observation(900, 3.0, "summarization")
    lengths = observed_workload(window, max_context_tokens=2048).lengths
    assert (lengths.prompt_tokens + lengths.output_tokens).max() <= 2048
    assert lengths.output_tokens.min() >= 1
    assert lengths.mean_prompt_tokens == pytest.approx(window.prompt.mean_tokens, rel=0.1)


@pytest.mark.parametrize("dataset", ["summarization", "chatbot", "code"])
def test_the_resampled_pairs_fit_the_context_and_keep_the_output_lengths(dataset):
    # summarization prompts fill the context (prompt + output ~1970 of 2048 tokens):
    # drawn independently, a long output beside a long prompt was cut, and the sample
    # lost a fifth of its decode tokens
    sample = load_lengths(dataset)
    window = replace(make_observation(900, 3.0, dataset),
                     prompt=fit_lengths(*make_histogram(sample.prompt_tokens)),
                     output=fit_lengths(*make_histogram(sample.output_tokens)))
    lengths = observed_workload(window, max_context_tokens=2048).lengths
    assert (lengths.prompt_tokens + lengths.output_tokens).max() <= 2048
    assert lengths.output_tokens.mean() == pytest.approx(sample.output_tokens.mean(), rel=0.06)
    assert lengths.prompt_tokens.mean() == pytest.approx(sample.prompt_tokens.mean(), rel=0.05)
    # the pairs are exchanged, not the lengths: the outputs drawn are the outputs kept
    rng = np.random.default_rng(0)
    window.prompt.sample(NUM_SAMPLES, rng, 2047)
    drawn = window.output.sample(NUM_SAMPLES, rng, 2047)
    cut = int((np.sort(drawn) != np.sort(lengths.output_tokens)).sum())
    assert cut <= 0.01 * NUM_SAMPLES


def code_and_summaries(rate_rps: float, window_s: float = 300.0, seed: int = 0):
    """A window of 65% code completions and 35% summaries, each prompt with its own output
    (summaries generate ~4x longer), Poisson at rate_rps: (arrivals, prompts, outputs)."""
    rng = np.random.default_rng(seed)
    code, summaries = load_lengths("code"), load_lengths("summarization")
    num = int(rate_rps * window_s)
    num_long = int(0.35 * num)
    short = rng.integers(0, len(code), num - num_long)
    long = rng.integers(0, len(summaries), num_long)
    order = rng.permutation(num)
    prompts = np.concatenate([code.prompt_tokens[short], summaries.prompt_tokens[long]])[order]
    outputs = np.concatenate([code.output_tokens[short], summaries.output_tokens[long]])[order]
    return np.cumsum(rng.exponential(1 / rate_rps, num)), prompts, outputs


def test_the_joint_histogram_keeps_long_outputs_with_long_prompts_and_the_miss_they_cause():
    # a decode instance holds a request's prompt and output in its KV cache until the
    # output ends: paired at random, the summaries' long outputs go to code prompts and
    # the KV the mix holds looks far smaller than it is
    rate_rps = 4.5
    arrivals, prompts, outputs = code_and_summaries(rate_rps)
    window = Observation(
        end_s=300.0, window_s=300.0, num_requests=len(prompts), arrival_rate_rps=rate_rps,
        arrival_cv=1.0, prompt=fit_lengths(*make_histogram(prompts)),
        output=fit_lengths(*make_histogram(outputs)), joint=make_joint(prompts, outputs))
    independent = replace(window, joint=None)
    long = prompts > 1000
    for observation, tolerance in ((window, 0.05), (independent, None)):
        lengths = observed_workload(observation, max_context_tokens=2048).lengths
        drawn_long = lengths.prompt_tokens > 1000
        means = (lengths.output_tokens[drawn_long].mean(), lengths.output_tokens[~drawn_long].mean())
        print(f"mean output of long / short prompts: sent {outputs[long].mean():.0f} / "
              f"{outputs[~long].mean():.0f}, resampled {means[0]:.0f} / {means[1]:.0f} "
              f"({'joint' if tolerance else 'independent'})")
        if tolerance:
            assert means[0] == pytest.approx(outputs[long].mean(), rel=tolerance)
            assert means[1] == pytest.approx(outputs[~long].mean(), rel=tolerance)
            assert (lengths.prompt_tokens + lengths.output_tokens).max() <= 2048
        else:  # drawn independently, long prompts get the mix's mean output
            assert means[0] < 0.6 * outputs[long].mean()
    # the morning's code plan (prefill tp2pp2, decode tp3pp1) on this window
    evaluator = make_evaluator()
    plan = placed_plan(evaluator, ((2, 2), (3, 1), 1, 1))
    ctx = evaluator.context(window, Correction())
    served = simulate_unit(ctx, evaluator.unit_of(ctx, plan), Trace(arrivals, prompts, outputs))
    paired = evaluator.predict(plan, window, rate_rps, Correction()).attainment
    unpaired = evaluator.predict(plan, independent, rate_rps, Correction()).attainment
    print(f"attainment: the window as it came {served.attainment(ctx.slo):.1%}, predicted "
          f"{paired:.1%} with the joint histogram, {unpaired:.1%} paired at random")
    assert served.attainment(ctx.slo) < 0.9 and paired < 0.9 <= unpaired


def test_scaling_keeps_the_shape_and_adds_copies_for_the_rate():
    evaluator = make_evaluator()
    plan = placed_plan(evaluator)
    window = make_observation(900, 3.0, "chatbot")
    one = evaluator.scale(plan, window, 1.0, Correction())
    more = evaluator.scale(plan, window, 8.0, Correction())
    assert change_kind(one, more) == "replicas"
    assert more.prefill.instances > one.prefill.instances
    assert evaluator.predict(more, window, 8.0, Correction()).attainment >= 0.9
    assert started_gpus(one, more) == more.num_gpus - one.num_gpus
    beyond = evaluator.scale(plan, window, 40.0, Correction())
    assert beyond.num_gpus == 32  # as many copies as the cluster holds


def test_the_search_on_summarization_traffic_picks_another_shape_than_on_code():
    evaluator = make_evaluator()
    plans = {
        dataset: evaluator.search(make_observation(900, 3.0, dataset), 3.0, Correction())
        for dataset in ("code", "summarization")
    }
    code, summarization = plans["code"], plans["summarization"]
    assert code.goodput_rps >= 3.0 and summarization.goodput_rps >= 3.0
    assert change_kind(code, summarization) in ("ratio", "parallelism")
    # long prompts: more GPUs per prefill instance, and more GPUs in all
    assert summarization.prefill.gpus_per_instance > code.prefill.gpus_per_instance
    assert summarization.num_gpus > code.num_gpus


class JudgedEvaluator(SearchEvaluator):
    """The search's plans per span and their predicted attainment, given (no simulation)."""

    def __init__(self, found: dict[int, tuple[int, float]],
                 grown: tuple[int, float] | None = None) -> None:
        super().__init__(parse_spec({**OPT_66B, "planner": {"maxNodesPerInstance": 4}}))
        self.found = found  # span -> (copies of the short shape, predicted attainment)
        self.grown = grown  # (copies, attainment) of the closest plan scaled up; None: no room

    def _planned(self, span, overrides):
        copies, _ = self.found[span]
        return placed_plan(self, copies=copies)

    def predict(self, plan, observation, rate_rps, correction):
        judged = {copies * 8: attainment for copies, attainment in self.found.values()}
        if self.grown is not None:
            judged.setdefault(self.grown[0] * 8, self.grown[1])
        return Prediction(rate_rps, judged[plan.num_gpus], 1.0, 0.05)

    def scale(self, plan, observation, rate_rps, correction):
        return None if self.grown is None else placed_plan(self, copies=self.grown[0])


@pytest.mark.parametrize(("found", "grown", "gpus"), [
    ({1: (1, 0.40), 2: (2, 0.95), 4: (3, 0.99)}, None, 16),  # the cheapest is predicted to miss
    ({1: (1, 0.20), 2: (2, 0.60), 4: (3, 0.50)}, None, 16),  # none meets: the closest
    ({1: (1, 0.93), 2: (2, 0.95), 4: (3, 0.99)}, None, 8),
    # none meets, and more copies of the closest (the search sized them on a minute of
    # arrivals) meet the target, or come no closer
    ({1: (1, 0.20), 2: (2, 0.60), 4: (3, 0.50)}, (4, 0.97), 32),
    ({1: (1, 0.20), 2: (2, 0.60), 4: (3, 0.50)}, (4, 0.55), 16),
])
def test_the_search_returns_the_cheapest_plan_predicted_to_meet_the_target(found, grown, gpus):
    evaluator = JudgedEvaluator(found, grown)
    plan = evaluator.search(make_observation(900, 3.0), 3.0, Correction())
    assert plan.num_gpus == gpus
