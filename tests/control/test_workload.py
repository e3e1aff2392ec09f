"""Workloads: shipped length samples, arrival processes, traces and their replay."""

import json

import numpy as np
import pytest

from distserve.workload import (
    TraceError,
    Workload,
    gamma_arrivals,
    load_lengths,
    load_trace,
    make_workload,
    poisson_arrivals,
)


def write_trace(tmp_path, records, name="trace.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def make_trace_records(n=10, gap_s=0.5):
    return [
        {"arrival_s": i * gap_s, "prompt_tokens": 100 + i, "output_tokens": 10 + i}
        for i in range(n)
    ]


@pytest.mark.parametrize(
    ("name", "min_requests", "prompt_range", "output_range"),
    [
        ("chatbot", 10_000, (500, 1100), (100, 350)),
        ("code", 1640, (80, 250), (30, 120)),
        ("summarization", 1000, (1500, 2000), (150, 400)),
    ],
)
def test_shipped_samples_have_the_applications_shape(
    name, min_requests, prompt_range, output_range
):
    sample = load_lengths(name)
    assert len(sample) >= min_requests
    assert prompt_range[0] < sample.mean_prompt_tokens < prompt_range[1]
    assert output_range[0] < sample.mean_output_tokens < output_range[1]
    totals = sample.prompt_tokens + sample.output_tokens
    assert (
        totals.max() <= 2048 and sample.output_tokens.min() >= 1 and sample.prompt_tokens.min() >= 1
    )


def test_code_is_humaneval_repeated_ten_times():
    sample = load_lengths("humaneval")
    assert len(sample) == 1640
    assert np.array_equal(sample.prompt_tokens[:164], sample.prompt_tokens[164:328])


def test_summarization_prompts_are_long_and_outputs_short_of_them():
    sample = load_lengths("summarization")
    assert np.all(sample.prompt_tokens + sample.output_tokens >= 1900)
    assert np.all(sample.prompt_tokens > sample.output_tokens)


def test_unknown_dataset_lists_known():
    with pytest.raises(ValueError, match="chatbot, code, summarization"):
        load_lengths("poetry")


def test_poisson_arrivals_have_the_rate_and_exponential_gaps():
    arrivals = poisson_arrivals(4.0, 20_000, np.random.default_rng(0))
    gaps = np.diff(arrivals)
    assert np.all(gaps >= 0)
    assert len(arrivals) / arrivals[-1] == pytest.approx(4.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_arrivals_keep_the_rate_and_set_the_burstiness(cv):
    arrivals = gamma_arrivals(3.0, 40_000, cv, np.random.default_rng(1))
    gaps = np.diff(arrivals)
    assert len(arrivals) / arrivals[-1] == pytest.approx(3.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_sample_is_reproducible_and_at_the_rate():
    workload = Workload.from_dataset("chatbot")
    first = workload.sample(rate_rps=2.0, num_requests=500, seed=7)
    assert first == workload.sample(rate_rps=2.0, num_requests=500, seed=7)
    assert first != workload.sample(rate_rps=2.0, num_requests=500, seed=8)
    assert [r.req_id for r in first] == list(range(500))
    assert 500 / first[-1].arrival_s == pytest.approx(2.0, rel=0.15)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(first, first[1:], strict=False))


def test_same_seed_gives_the_same_lengths_at_every_rate():
    workload = Workload.from_dataset("code", arrival="gamma", cv=2.0)
    slow, fast = workload.sample(1.0, 100, seed=3), workload.sample(10.0, 100, seed=3)
    assert [r.prompt_tokens for r in slow] == [r.prompt_tokens for r in fast]
    assert fast[-1].arrival_s == pytest.approx(slow[-1].arrival_s / 10)


def test_trace_loads_in_file_order(tmp_path):
    requests = load_trace(write_trace(tmp_path, make_trace_records(3)))
    assert [(r.req_id, r.arrival_s, r.prompt_tokens, r.output_tokens) for r in requests] == [
        (0, 0.0, 100, 10),
        (1, 0.5, 101, 11),
        (2, 1.0, 102, 12),
    ]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"arrival_s": 1.0, "prompt_tokens": 5}', r":2: field 'output_tokens' is missing"),
        (
            '{"arrival_s": 1.0, "prompt_tokens": 0, "output_tokens": 3}',
            r":2: field 'prompt_tokens' must be a positive integer",
        ),
        (
            '{"arrival_s": -1, "prompt_tokens": 5, "output_tokens": 3}',
            r":2: field 'arrival_s' must be a non-negative",
        ),
        (
            '{"arrival_s": 1.0, "prompt_tokens": 5.5, "output_tokens": 3}',
            r":2: field 'prompt_tokens'",
        ),
        ('{"arrival_s": "soon", "prompt_tokens": 5, "output_tokens": 3}', r":2: field 'arrival_s'"),
        ("not json", r":2: not JSON"),
        ("[1, 2, 3]", r":2: expected an object"),
    ],
)
def test_bad_trace_line_names_line_and_field(tmp_path, bad_line, message):
    path = write_trace(tmp_path, [make_trace_records(1)[0], bad_line])
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_empty_or_missing_trace_is_refused(tmp_path):
    with pytest.raises(TraceError, match="no requests"):
        load_trace(write_trace(tmp_path, ["", "  "]))
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "absent.jsonl")


def test_trace_replay_keeps_lengths_and_scales_its_pattern(tmp_path):
    # a bursty trace: pairs of requests 0.1 s apart, pairs 1.9 s apart (mean gap 1 s)
    records, t = [], 0.0
    for i in range(20):
        records.append({"arrival_s": t, "prompt_tokens": 10 * (i + 1), "output_tokens": i + 1})
        t += 0.1 if i % 2 == 0 else 1.9
    workload = make_workload(trace_path=write_trace(tmp_path, records), arrival="trace")
    assert workload.trace_rate_rps == pytest.approx(19 / records[-1]["arrival_s"])
    native = workload.sample(rate_rps=workload.trace_rate_rps, num_requests=20)
    assert [r.prompt_tokens for r in native] == [10 * (i + 1) for i in range(20)]
    native_gaps = np.diff([r.arrival_s for r in native])
    assert native_gaps == pytest.approx(np.diff([r["arrival_s"] for r in records]))
    fast = workload.sample(rate_rps=workload.trace_rate_rps * 4, num_requests=45)
    fast_gaps = np.diff([r.arrival_s for r in fast])
    assert fast_gaps[:19] == pytest.approx(native_gaps / 4)
    assert [r.output_tokens for r in fast[20:25]] == [1, 2, 3, 4, 5]  # cycles


def test_trace_lengths_with_poisson_arrivals(tmp_path):
    path = write_trace(tmp_path, make_trace_records(50))
    requests = make_workload(trace_path=path, arrival="poisson").sample(5.0, 50, seed=0)
    assert [r.prompt_tokens for r in requests] == list(range(100, 150))
    assert np.diff([r.arrival_s for r in requests]).std() > 0.05  # not the trace's even gaps


def test_trace_without_a_pattern_cannot_be_scaled(tmp_path):
    path = write_trace(tmp_path, [{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 2}] * 3)
    with pytest.raises(TraceError, match="all arrive at once"):
        make_workload(trace_path=path, arrival="trace")
    assert len(make_workload(trace_path=path, arrival="poisson").sample(1.0, 4)) == 4


def test_bad_arrival_settings_are_refused():
    with pytest.raises(ValueError, match="poisson, gamma, trace"):
        Workload.from_dataset("chatbot", arrival="uniform")
    with pytest.raises(ValueError, match="cv must be positive"):
        Workload.from_dataset("chatbot", arrival="gamma", cv=0)
    with pytest.raises(ValueError, match="rate_rps must be positive"):
        Workload.from_dataset("chatbot").sample(0, 10)
