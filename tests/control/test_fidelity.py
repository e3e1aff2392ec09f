"""`distserve fidelity`'s plumbing: one trace replayed at three rates around the simulated
knee, each measured figure printed beside the simulator's with the load average (the
deployment and the load generator replaced by fakes; no figure is compared)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from distserve.cli.fidelity import KNEE_FACTORS, WARMUP_REQUESTS, _sample_trace, compare_deployment
from distserve.local.load import Outcome
from distserve.spec import load_manifest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class FakeClient:
    """Every request answered at once with TTFT 1 s and TPOT 0.1 s; what was sent, kept."""

    def __init__(self) -> None:
        self.sent: list[list] = []

    def __call__(self, url, requests):
        self.sent.append(list(requests))
        return [Outcome(r.req_id, r.prompt_tokens, r.output_tokens, 1.0, 0.1, r.output_tokens)
                for r in requests]


@pytest.mark.parametrize("num_colocated", [0, 2])
def test_one_trace_at_three_rates_around_the_knee_measured_beside_simulated(num_colocated, capsys):
    spec = load_manifest(EXAMPLES / "local.yaml").spec
    trace = _sample_trace(spec, 12)
    client, launched = FakeClient(), []

    def launch(settings, port):
        launched.append(settings.instances)
        return contextlib.nullcontext(SimpleNamespace(url=f"http://127.0.0.1:{port}"))

    rows = compare_deployment(spec, None, "local", "/model", num_colocated, trace, None, 18000,
                              drive_fn=client, launch=launch,
                              iterations_fn=lambda _: {})
    out = capsys.readouterr().out
    assert launched == [{"colocated": 2} if num_colocated else {"prefill": 1, "decode": 1}]
    knee = float(re.search(r"simulated knee ([\d.]+) req/s", out).group(1))
    rates = [rate for rate, *_ in rows]
    assert rates == pytest.approx([knee * f for f in KNEE_FACTORS], rel=1e-2)
    warmup, *replays = client.sent
    assert len(warmup) == WARMUP_REQUESTS and len(replays) == 3
    for rate, sent in zip(rates, replays, strict=True):  # the same requests, arrivals scaled
        assert [r.prompt_tokens for r in sent] == trace.prompt_tokens.tolist()
        assert np.allclose([r.arrival_s for r in sent], trace.arrival_s / rate)
    body, tally = out.split("\n\n")[-2:]
    blocks = body.split(" req/s: ")[1:]
    assert len(blocks) == 3
    for block in blocks:
        for figure in ("attainment", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90"):
            (line,) = [line for line in block.splitlines() if line.strip().startswith(figure)]
            assert "measured" in line and "simulated" in line and "load " in line
        assert "TTFT p50    measured   1.000 s" in block
    # the last line counts the verdicts of the blocks above it
    verdicts = re.findall(r"^  (attainment|TTFT p\d\d|TPOT p\d\d) .*  (within|outside) ", body, re.M)
    met = [label for label, verdict in verdicts if verdict == "within"]
    assert len(verdicts) == 15
    assert tally.startswith(f"{'2 colocated' if num_colocated else '1 prefill + 1 decode'}: "
                            "the simulator within the goal (2 pt, 10%) for attainment at "
                            f"{met.count('attainment')} of 3 runs and for "
                            f"{len(met) - met.count('attainment')} of 12 percentiles (TTFT p50 "
                            f"{met.count('TTFT p50')}, TTFT p90 {met.count('TTFT p90')}, ")


def test_a_request_that_failed_is_named_with_its_error_not_only_counted(capsys):
    spec = load_manifest(EXAMPLES / "local.yaml").spec
    trace = _sample_trace(spec, 6)

    def one_fails(url, requests):
        out = [Outcome(r.req_id, r.prompt_tokens, r.output_tokens, 1.0, 0.1, r.output_tokens)
               for r in requests]
        if len(requests) > WARMUP_REQUESTS:
            out[3] = Outcome(out[3].req_id, out[3].prompt_tokens, out[3].output_tokens,
                             status=503, error="no healthy decode instance")
        return out

    def launch(settings, port):
        return contextlib.nullcontext(SimpleNamespace(url=f"http://127.0.0.1:{port}"))

    compare_deployment(spec, None, "local", "/model", 0, trace, [0.1], 18000,
                       drive_fn=one_fails, launch=launch, iterations_fn=lambda _: {})
    out = capsys.readouterr().out
    assert "failed at 0.1 req/s (1 request): HTTP 503: no healthy decode instance" in out
    assert "6 requests, 1 errors" in out


def test_repeat_replays_each_rate_and_says_how_far_apart_the_replays_lie(capsys):
    spec = load_manifest(EXAMPLES / "local.yaml").spec
    trace = _sample_trace(spec, 12)
    sent = []

    def slower_each_replay(url, requests):
        """Replay k answers with TTFT k s; in replays after the first, 2 requests miss the
        TTFT SLO (6 s)."""
        sent.append(list(requests))
        if len(requests) == WARMUP_REQUESTS:
            return [Outcome(r.req_id, r.prompt_tokens, r.output_tokens, 1.0, 0.1, r.output_tokens)
                    for r in requests]
        k = len(sent) - 1  # 1, 2, ...
        return [Outcome(r.req_id, r.prompt_tokens, r.output_tokens,
                        60.0 if k > 1 and i < 2 else float(k), 0.1, r.output_tokens)
                for i, r in enumerate(requests)]

    def launch(settings, port):
        return contextlib.nullcontext(SimpleNamespace(url=f"http://127.0.0.1:{port}"))

    rows = compare_deployment(spec, None, "local", "/model", 0, trace, [0.5], 18000,
                              drive_fn=slower_each_replay, launch=launch,
                              iterations_fn=lambda _: {}, repeat=2)
    out = capsys.readouterr().out
    _, first, second = sent
    assert [r.arrival_s for r in first] == [r.arrival_s for r in second]  # the same requests
    assert len(rows) == 2 and "replay 2 of 2 at 0.5 req/s" in out
    block = out[out.index("1 prefill + 1 decode at 0.5 req/s, 2 replays of the same requests"):]
    lines = {line.split()[0] + " " + line.split()[1]: line for line in block.splitlines()[1:6]}
    # 12 of 12 met, then 10 of 12: 16.7 points apart, more than twice the goal's 2 points
    assert "measured 83.3-100.0 %, 16.7 pt apart: no one figure is within 2 pt of every replay" in lines["attainment measured"]
    # TTFT p50 1 s, then 2 s: no figure is within 10% of both
    assert "measured 1.000-2.000 s, highest x2.00 the lowest: no one figure is within 10%" in lines["TTFT p50"]
    # TPOT 0.1 s in both: one figure can be within 10% of each
    assert "measured 0.100-0.100 s, highest x1.00 the lowest: one figure can be within 10%" in lines["TPOT p50"]
    assert len(lines["TTFT p50"].split("gaps ")[1].split(", ")) == 2  # a gap per replay


def test_repeat_below_one_is_refused_naming_the_option(capsys):
    from distserve.cli import main
    from distserve.cli.up import EXIT_USAGE_ERROR

    code = main(["fidelity", "-f", str(EXAMPLES / "local.yaml"), "--repeat", "0"])
    assert code == EXIT_USAGE_ERROR
    assert "--repeat must be >= 1, got 0" in capsys.readouterr().err


def test_a_save_folder_that_cannot_be_made_is_refused_naming_the_option(tmp_path, capsys):
    from distserve.cli import main
    from distserve.cli.up import EXIT_USAGE_ERROR

    taken = tmp_path / "a-file"
    taken.write_text("not a folder")
    code = main(["fidelity", "-f", str(EXAMPLES / "local.yaml"), "--save", str(taken / "runs")])
    assert code == EXIT_USAGE_ERROR
    assert f"--save '{taken / 'runs'}': cannot make that folder" in capsys.readouterr().err
