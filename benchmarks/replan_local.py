"""`distserve up --replan` with SmolLM2 on this machine's CPU: traffic that shifts from
short to long prompts under load, the decisions it takes, the reshuffle, and what the
clients saw.

Writes a spec derived from examples/local.yaml: more CPU "slots" than the starting
placement of one prefill and one decode instance, so a bigger plan fits, and SLOs loose
enough for this machine's measured profile (a decode step of SmolLM2 takes 0.3-0.6 s on
two loaded cores). Starts `distserve up -f SPEC --replan ...` as a subprocess with fast
replanning settings, then sends Poisson arrivals at one rate: short prompts, long ones
(real token ids, a fixed seed), and short ones again. Prints the spec's settings, the
load of each phase with the load average, every `decision:` and `reshuffle:` line as it
comes, the requests each instance served, and the requests sent, completed (200 with
every output token), refused (429) and failed (anything else). Lets a reshuffle under
way finish, stops `distserve up` with SIGINT and checks that none of its processes is
left. Prints figures only; it asserts nothing.

NOTE: with `placement` in the spec the search answers the placement itself, so the
replans seen here change the number of copies (`scale`), not the prefill:decode ratio.

    .venv/bin/python benchmarks/replan_local.py [--rate 0.35] [--short-s 60] [--long-s 180]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
LOCAL_SPEC = ROOT / "examples" / "local.yaml"
CLI = [sys.executable, "-c", "import sys; from distserve.cli import main; sys.exit(main(sys.argv[1:]))"]
REQUEST_TIMEOUT_S = 600.0  # a long prompt queued behind an overloaded prefill waits minutes
STARTUP_TIMEOUT_S = 600.0  # a first run on this machine measures its latency profile
RESHUFFLE_TIMEOUT_S = 180.0  # starting an instance took 85-90 s on two loaded cores
PRINTED_PREFIXES = ("decision:", "reshuffle:", "plan:", "profile:", "replanning:", "error")
VOCAB_LOW, VOCAB_HIGH = 100, 40000  # ordinary token ids of SmolLM2's 49152-token vocabulary
T0_S = time.monotonic()


def stamp() -> str:
    """Seconds since the benchmark started, as every printed event shows them."""
    return f"[{time.monotonic() - T0_S:6.1f} s]"


@dataclass(frozen=True)
class Phase:
    """One stretch of the load: Poisson arrivals at `rate_rps` with fixed lengths."""

    name: str
    duration_s: float
    rate_rps: float
    prompt_tokens: int
    output_tokens: int


@dataclass
class PhaseCounts:
    """What the clients saw of one phase's requests."""

    sent: int = 0
    completed: int = 0
    refused: int = 0  # 429: the router's admission control said no
    failures: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)


def write_spec(path: Path, num_slots: int, rate_rps: float, ttft_slo_s: float,
               tpot_slo_s: float) -> dict:
    """examples/local.yaml with `num_slots` CPU slots (the starting placement stays 1 + 1),
    the given SLOs and the phases' rate as the sized rate; relative paths made absolute.
    Returns the doc."""
    doc = yaml.safe_load(LOCAL_SPEC.read_text())
    spec = doc["spec"]
    doc["metadata"]["name"] = "replan-local"
    spec["cluster"]["gpusPerNode"] = num_slots
    spec["slo"].update(ttftSeconds=ttft_slo_s, tpotSeconds=tpot_slo_s)
    spec["workload"]["rateRps"] = rate_rps
    spec["workload"]["tracePath"] = str(LOCAL_SPEC.parent / spec["workload"]["tracePath"])
    spec["planner"]["profilePath"] = str(LOCAL_SPEC.parent / spec["planner"]["profilePath"])
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return doc


def free_port_block(size: int) -> int:
    """A port p with p .. p+size-1 free, drawn below the kernel's ephemeral range."""
    draw = random.Random(time.monotonic_ns())
    for _ in range(200):
        port = draw.randrange(12000, 30000 - size)
        if all(_can_bind(port + i) for i in range(size)):
            return port
    raise SystemExit("no free block of ports")


def _can_bind(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class UpProcess:
    """`distserve up` in its own process group; its output lines kept, the interesting
    ones printed as they come."""

    def __init__(self, args: list[str]) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen([*CLI, *args], cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip()
            self.lines.append(line)
            if line.startswith(PRINTED_PREFIXES):
                print(f"{stamp()} {line}", flush=True)

    def wait_for(self, prefix: str, timeout_s: float) -> bool:
        """Whether a line starting with `prefix` came before the timeout (or the exit)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if any(line.startswith(prefix) for line in self.lines):
                return True
            time.sleep(0.5)
        return any(line.startswith(prefix) for line in self.lines)

    def wait_for_reshuffles(self, timeout_s: float) -> bool:
        """Whether every reshuffle begun (`reshuffle: to`) has ended (done or skipped)
        before the timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            begun = sum(line.startswith("reshuffle: to") for line in self.lines)
            ended = sum(line.startswith(("reshuffle: done", "reshuffle: skipped"))
                        for line in self.lines)
            if begun == ended:
                return True
            time.sleep(1.0)
        return False

    def stop(self) -> tuple[int | None, bool]:
        """SIGINT, wait; SIGKILL to the group as a fallback. Returns the exit code and
        whether any process of the group was still alive after it exited."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            code = None
        self.reader.join(timeout=10)
        time.sleep(1.0)
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return code, False
        os.killpg(self.proc.pid, signal.SIGKILL)
        return code, True


async def send(client: httpx.AsyncClient, url: str, phase: Phase, draw: random.Random,
               counts: PhaseCounts) -> None:
    """One completion of the phase's lengths; counted as completed, refused or failed."""
    body = {"prompt": [draw.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(phase.prompt_tokens)],
            "max_tokens": phase.output_tokens, "ignore_eos": True}
    counts.sent += 1
    start_s = time.monotonic()
    try:
        r = await client.post(f"{url}/v1/completions", json=body)
    except httpx.HTTPError as err:
        counts.failures.append(repr(err))
        return
    if r.status_code == 429:
        counts.refused += 1
    elif r.status_code != 200:
        counts.failures.append(f"{r.status_code} {r.text[:200]}")
    elif r.json()["usage"]["completion_tokens"] != phase.output_tokens:
        counts.failures.append(f"200 with {r.json()['usage']['completion_tokens']} tokens")
    else:
        counts.completed += 1
        counts.latencies_s.append(time.monotonic() - start_s)


async def drive(url: str, phases: list[Phase], seed: int) -> dict[str, PhaseCounts]:
    """Each phase's Poisson arrivals in turn; waits for every request to finish."""
    draw = random.Random(seed)
    phase_to_counts = {phase.name: PhaseCounts() for phase in phases}
    tasks: list[asyncio.Task] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=20)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        for phase in phases:
            load1, load5, _ = os.getloadavg()
            print(f"{stamp()} load: phase {phase.name}: {phase.duration_s:.0f} s at {phase.rate_rps} req/s "
                  f"(Poisson), prompts {phase.prompt_tokens} tokens, outputs "
                  f"{phase.output_tokens}; load average {load1:.2f} (1 min) {load5:.2f} (5 min)",
                  flush=True)
            end_s = time.monotonic() + phase.duration_s
            while (wait_s := draw.expovariate(phase.rate_rps)) < end_s - time.monotonic():
                await asyncio.sleep(wait_s)
                tasks.append(asyncio.create_task(
                    send(client, url, phase, draw, phase_to_counts[phase.name])))
            await asyncio.sleep(max(0.0, end_s - time.monotonic()))
        print(f"{stamp()} load: all sent; waiting for {sum(not t.done() for t in tasks)} in flight",
              flush=True)
        await asyncio.gather(*tasks)
    return phase_to_counts


def requests_per_instance(url: str) -> dict[str, int]:
    """Finished requests per prefill and decode instance, from the router's recent
    timelines (`/debug/timelines`: the last 2,000)."""
    timelines = httpx.get(f"{url}/debug/timelines", params={"limit": 2000}, timeout=10).json()
    name_to_count: dict[str, int] = {}
    for timeline in timelines:
        for name in (timeline["prefill_instance"], timeline["decode_instance"]):
            if name is not None:
                name_to_count[name] = name_to_count.get(name, 0) + 1
    return name_to_count


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of values (nearest rank); NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(phase_to_counts: dict[str, PhaseCounts], up: UpProcess,
           name_to_count: dict[str, int]) -> None:
    """The decisions, reshuffles, tokens per instance and request counts."""
    print("\n== decisions")
    for line in up.lines:
        if line.startswith("decision:"):
            print(line)
    print("\n== reshuffles")
    for line in up.lines:
        if line.startswith("reshuffle:"):
            print(line)
    print("\n== requests per instance (the router's timelines, before the stop)")
    print(", ".join(f"{name} {count}" for name, count in sorted(name_to_count.items())))
    print("\n== requests")
    for name, c in phase_to_counts.items():
        print(f"{name:6s} sent {c.sent} completed {c.completed} refused {c.refused} failed "
              f"{len(c.failures)}; latency p50 {percentile(c.latencies_s, 0.5):.1f} s p90 "
              f"{percentile(c.latencies_s, 0.9):.1f} s")
    every = list(phase_to_counts.values())
    failures = [f for c in every for f in c.failures]
    print(f"requests sent {sum(c.sent for c in every)} completed "
          f"{sum(c.completed for c in every)} failed {len(failures)} "
          f"(refused 429: {sum(c.refused for c in every)})")
    for failure in failures[:10]:
        print(f"  failed: {failure}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=4, help="cluster.gpusPerNode (CPU slots)")
    parser.add_argument("--rate", type=float, default=0.35, help="req/s in every phase")
    parser.add_argument("--ttft-slo", type=float, default=8.0, help="slo.ttftSeconds")
    parser.add_argument("--tpot-slo", type=float, default=1.0, help="slo.tpotSeconds")
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=192)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--short-s", type=float, default=60.0)
    parser.add_argument("--long-s", type=float, default=180.0)
    parser.add_argument("--tail-s", type=float, default=60.0,
                        help="short prompts again after the long ones")
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--hold", type=float, default=10.0)
    parser.add_argument("--cooldown", type=float, default=60.0)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="replan-local-"))
    spec_path = workdir / "spec.yaml"
    doc = write_spec(spec_path, args.slots, args.rate, args.ttft_slo, args.tpot_slo)["spec"]
    replan = ["--replan-interval", args.interval, "--replan-window", args.window,
              "--replan-hold", args.hold, "--replan-cooldown", args.cooldown,
              "--replan-min-requests", args.min_requests]
    port = free_port_block(2 * args.slots + 2)  # the router, the instances, their successors
    command = ["up", "-f", str(spec_path), "--port", str(port), "--replan", *map(str, replan)]
    print(f"spec: {spec_path}: {doc['model']['name']} on {doc['cluster']['accelerator']}, "
          f"{doc['cluster']['nodes']} x {doc['cluster']['gpusPerNode']} slots, placement "
          f"{doc['placement']['prefill']['instances']} prefill + "
          f"{doc['placement']['decode']['instances']} decode, SLO TTFT <= "
          f"{doc['slo']['ttftSeconds']} s TPOT <= {doc['slo']['tpotSeconds']} s at "
          f"{doc['slo']['attainment']:.0%}, workload.rateRps {doc['workload']['rateRps']}")
    print(f"command: distserve {' '.join(command)}", flush=True)
    phases = [Phase("short", args.short_s, args.rate, args.short_tokens, args.output_tokens),
              Phase("long", args.long_s, args.rate, args.long_tokens, args.output_tokens),
              Phase("tail", args.tail_s, args.rate, args.short_tokens, args.output_tokens)]
    up = UpProcess(command)
    phase_to_counts: dict[str, PhaseCounts] = {}
    name_to_count: dict[str, int] = {}
    try:
        if not up.wait_for("replanning: Prometheus at", STARTUP_TIMEOUT_S):
            print("\n".join(up.lines[-40:]))
            return 1
        url = f"http://127.0.0.1:{port}"
        phase_to_counts = asyncio.run(drive(url, phases, args.seed))
        # NOTE: a reshuffle the last windows decided is let finish before the stop, so
        # that the printed one is complete, not cut short by SIGINT.
        if not up.wait_for_reshuffles(RESHUFFLE_TIMEOUT_S):
            print(f"{stamp()} a reshuffle was still running after {RESHUFFLE_TIMEOUT_S:.0f} s")
        name_to_count = requests_per_instance(url)
    finally:
        code, was_left = up.stop()
        load1, load5, _ = os.getloadavg()
        print(f"{stamp()} stopped: distserve up exited {code}; processes left after it: "
              f"{'yes (killed)' if was_left else 'none'}; load average {load1:.2f} (1 min) "
              f"{load5:.2f} (5 min)")
    report(phase_to_counts, up, name_to_count)
    return 0


if __name__ == "__main__":
    sys.exit(main())
