"""`distserve up --replan` with the tiny model: the reshuffle under load loses no request,
and the loop's decisions come from a real Prometheus scraping the launched processes
while the traffic shifts from short to long prompts."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_process import require_prometheus
from serving_helpers import make_settings, tiny_spec_yaml, wait_until
from test_up import CLI, _is_free, free_port_block

from distserve.local.launcher import LocalLauncher
from distserve.local.reshuffle import reshuffle, router_instances
from distserve_engine.server.settings import Parallelism, PlanInfo


class SteadyLoad:
    """`num_clients` clients sending completions back to back until stopped; counts
    what was sent, completed (200 with every token) and failed (anything else)."""

    def __init__(self, url: str, num_clients: int = 3, prompt_tokens: int = 24,
                 output_tokens: int = 8) -> None:
        self.url, self.prompt_tokens, self.output_tokens = url, prompt_tokens, output_tokens
        self.sent = self.completed = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                         for i in range(num_clients)]

    def _client(self, index: int) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                body = {"prompt": [7 + (index + i) % 200 for i in range(self.prompt_tokens)],
                        "max_tokens": self.output_tokens, "ignore_eos": True}
                with self._lock:
                    self.sent += 1
                try:
                    r = client.post(f"{self.url}/v1/completions", json=body)
                    ok = r.status_code == 200 and (
                        r.json()["usage"]["completion_tokens"] == self.output_tokens)
                    why = "" if ok else f"{r.status_code} {r.text[:200]}"
                except httpx.HTTPError as err:
                    why = repr(err)
                with self._lock:
                    if why:
                        self.failures.append(why)
                    else:
                        self.completed += 1

    def __enter__(self) -> SteadyLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)

    def counts(self) -> dict[str, int]:
        return {"sent": self.sent, "completed": self.completed, "failed": len(self.failures)}


@pytest.mark.slow
def test_reshuffle_under_load_replaces_and_adds_instances_losing_nothing(tiny_model):
    """The function the loop calls on a replan, given two plans' settings in a row: a new
    prefill parallelism (prefill-0 replaced by a tp2 prefill-1, drained while serving),
    then a second decode instance (both kept, one started)."""
    plan = {"id": "plan-a", "prefill": "tp1pp1x1", "decode": "tp1pp1x1"}
    settings = make_settings(tiny_model, deployment="reshuffled", plan=plan)
    new_parallel = dataclasses.replace(
        settings, parallel={"prefill-0": Parallelism(tp=2, pp=1), "decode-0": Parallelism()},
        plan=PlanInfo("plan-b", prefill="tp2pp1x1", decode="tp1pp1x1"))
    more_decode = dataclasses.replace(
        new_parallel, instances={"prefill": 1, "decode": 2},
        parallel={**new_parallel.parallel, "decode-1": Parallelism()},
        plan=PlanInfo("plan-c", prefill="tp2pp1x1", decode="tp1pp1x2"))
    with LocalLauncher(settings, port=free_port_block(3)) as launcher:
        old_prefill = next(p for p in launcher.procs if p.name == "prefill-0")
        with SteadyLoad(launcher.url) as load:
            assert wait_until(lambda: load.completed >= 5, timeout_s=60)
            first = reshuffle(launcher, new_parallel, progress=print)
            at_first = load.counts()
            second = reshuffle(launcher, more_decode, progress=print)
            assert wait_until(lambda: load.completed >= at_first["completed"] + 5, timeout_s=60)
        counts = load.counts()
        print(f"\nreshuffles: {first.describe()} | {second.describe()}; requests {counts}")
        assert load.failures == [] and counts["completed"] == counts["sent"]
        assert at_first["completed"] > 5  # requests were served through the first move
        assert (first.started, first.kept, first.stopped) == (
            ("prefill-1",), ("decode-0",), ("prefill-0",))
        assert (second.started, second.kept, second.stopped) == (
            ("decode-1",), ("prefill-1", "decode-0"), ())
        assert set(router_instances(launcher.url)) == {"prefill-1", "decode-0", "decode-1"}
        assert old_prefill.handle is None and _is_free(old_prefill.port)  # the old one stopped
        assert sorted(p.name for p in launcher.procs[:-1]) == ["decode-0", "decode-1", "prefill-1"]
        assert launcher.procs[-1].role == "router"
        text = httpx.get(f"{launcher.url}/metrics", timeout=10).text
        assert 'plan_id="plan-c"' in text  # the router took the new plan from its file


SHORT_PROMPT_TOKENS, LONG_PROMPT_TOKENS = 12, 180
PHASE_S = 30.0


@pytest.mark.slow
def test_up_replan_decides_on_observed_shift_from_short_to_long_prompts(tiny_model, tmp_path):
    """`distserve up --replan` end to end: its own Prometheus, 5 s decisions over 15 s
    windows; short prompts, then long ones. Every request completes (the loop survives a
    window the evaluator fails on), decisions are taken on real observations (not
    `no-decision`), and a shift against the reference window triggers."""
    require_prometheus()
    spec = tmp_path / "tiny.yaml"
    spec.write_text(tiny_spec_yaml(tiny_model, "tiny-replan"))
    port = free_port_block()
    args = ["up", "-f", str(spec), "--port", str(port), "--no-measure", "--replan",
            "--replan-interval", "5", "--replan-window", "15", "--replan-hold", "5",
            "--replan-cooldown", "30", "--replan-min-requests", "10"]
    proc = subprocess.Popen([sys.executable, "-c", CLI, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: any("replanning: Prometheus at" in line for line in lines),
                          timeout_s=240), "".join(lines)
        with SteadyLoad(url, prompt_tokens=SHORT_PROMPT_TOKENS) as load:
            time.sleep(PHASE_S)
            load.prompt_tokens = LONG_PROMPT_TOKENS
            time.sleep(PHASE_S)
        proc.send_signal(signal.SIGINT)
        exit_code = proc.wait(timeout=120)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    decisions = [line.strip() for line in lines if line.startswith("decision:")]
    print("\n" + "\n".join(decisions) + f"\nrequests {load.counts()}")
    assert exit_code == 0, "".join(lines[-40:])
    assert load.failures == [] and load.completed == load.sent > 0
    taken = [d for d in decisions if not d.startswith("decision: no-decision")]
    assert taken, decisions  # a window held enough requests and both length histograms
    # NOTE: a trigger (a shift held against the reference window) is seen; which figure
    # shifted first depends on how the windows fall, so it is printed, not asserted.
    assert any(re.search(r"(?<!no )shift \(", d) for d in taken), decisions
    if any(d.startswith("decision: replan") for d in decisions):
        assert any(line.startswith("reshuffle: done") for line in lines), "".join(lines)
