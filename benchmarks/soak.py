"""Soak: a local deployment under steady load for `--minutes`, watched for leaks.

SmolLM2-135M, 1 prefill + 1 decode instance (one core each) and the router, started by
the local launcher. The rate is `--rate`, else `--fraction` (0.8) of the capacity
measured first (a burst of requests sent at once: requests / makespan). Poisson requests
run for the whole window; every `--sample-s` seconds (60) it records, per process, the
resident memory (RSS) and open file descriptors, per instance the KV cache in use (from
its /load), and the KV shared-memory files under /dev/shm. After the load it waits for
the instances to go idle and checks: KV in use back to 0 on every instance, no more
shared-memory files than at the start, and the growth of RSS and descriptors. The
curves go to a PNG (`--png`).

    python benchmarks/soak.py --minutes 30 [--rate R | --fraction 0.8] [--sample-s 60]
    python benchmarks/soak.py --minutes 5 --fraction 5 --max-waiting 0   # overload
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
from pathlib import Path

import httpx
from admission_goodput import PORT, calibrate, make_requests

from distserve.local.launcher import LocalLauncher
from distserve.local.load import drive
from distserve.local.settings import find_model_path, serve_settings
from distserve.spec import load_manifest

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "distserve-kv-"
IDLE_TIMEOUT_S = 120.0


def process_figures(pid: int) -> tuple[float, int]:
    """(RSS in MiB, open file descriptors) of a process."""
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def shm_files() -> int:
    """KV shared-memory files (arenas and tokens) now."""
    return sum(1 for p in SHM_DIR.glob(f"{SHM_PREFIX}*")) if SHM_DIR.is_dir() else 0


def sample(launcher: LocalLauncher, elapsed_s: float) -> dict:
    """One row: per process RSS and FDs, per instance KV in use, shm files."""
    row = {"t_min": elapsed_s / 60, "shm_files": shm_files(), "rss_mib": {}, "fds": {},
           "kv_usage": {}}
    for proc in launcher.procs:
        row["rss_mib"][proc.name], row["fds"][proc.name] = process_figures(proc.handle.pid)
        if proc.role != "router":
            row["kv_usage"][proc.name] = httpx.get(f"{proc.url}/load", timeout=10).json()["kv_usage"]
    return row


def print_row(row: dict) -> None:
    procs = "  ".join(f"{n} {row['rss_mib'][n]:.0f} MiB/{row['fds'][n]} fd" for n in row["rss_mib"])
    kv = " ".join(f"{n} {u:.1%}" for n, u in row["kv_usage"].items())
    print(f"t {row['t_min']:5.1f} min  {procs}  KV {kv}  shm files {row['shm_files']}  "
          f"load {os.getloadavg()[0]:.2f}", flush=True)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t_min"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for key, ax, label in (("rss_mib", axes[0, 0], "RSS (MiB)"), ("fds", axes[0, 1], "open FDs"),
                           ("kv_usage", axes[1, 0], "KV in use (fraction)")):
        for name in rows[0][key]:
            ax.plot(t, [r[key][name] for r in rows], marker="o", label=name)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    axes[1, 1].plot(t, [r["shm_files"] for r in rows], marker="o")
    axes[1, 1].set_ylabel("KV shm files")
    for ax in axes[1]:
        ax.set_xlabel("minutes")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def wait_idle(launcher: LocalLauncher) -> bool:
    """True once every instance holds no KV and runs nothing (bounded)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while time.monotonic() < deadline:
        loads = [httpx.get(f"{p.url}/load", timeout=10).json() for p in launcher.procs
                 if p.role != "router"]
        if all(ld["kv_usage"] == 0 and not ld["num_running"] and not ld["num_held"]
               and not ld["num_waiting"] for ld in loads):
            return True
        time.sleep(1)
    return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=None, help="req/s (default: a fraction of capacity)")
    parser.add_argument("--fraction", type=float, default=0.8)
    parser.add_argument("--sample-s", type=float, default=60.0)
    parser.add_argument("--png", default="soak.png")
    parser.add_argument("--max-waiting", type=int, default=1024,
                        help="the router's waiting bound (a soak looks for leaks, not refusals; "
                             "0: the deployment's own, as in an overload run)")
    args = parser.parse_args()
    spec = load_manifest("examples/local.yaml").spec
    settings = serve_settings(spec, {"prefill": 1, "decode": 1}, "soak", find_model_path(spec))
    if args.max_waiting:
        settings.max_waiting_requests = args.max_waiting
    print(f"router bounds: {settings.max_waiting_requests} waiting, in flight "
          f"{settings.max_inflight_requests or 'waiting + 2 decode batches'} (decode batch "
          f"{settings.max_decode_batch})", flush=True)
    print(f"load average before: {os.getloadavg()}; shm files before: {shm_files()}", flush=True)
    shm_before = shm_files()
    with LocalLauncher(settings, port=PORT) as launcher:
        model = settings.model_name
        rate_rps = args.rate
        if rate_rps is None:
            _, _, capacity_rps = calibrate(launcher.url, model)
            rate_rps = args.fraction * capacity_rps
            print(f"capacity {capacity_rps:.2f} req/s; soak at {args.fraction:.0%}: "
                  f"{rate_rps:.2f} req/s", flush=True)
        num = max(1, int(rate_rps * args.minutes * 60))
        requests = make_requests(rate_rps, num, seed=1)
        outcomes: list = []
        driver = threading.Thread(target=lambda: outcomes.extend(
            asyncio.run(drive(launcher.url, model, requests, show_progress=False))))
        started_s = time.monotonic()
        driver.start()
        rows = [sample(launcher, 0.0)]
        print_row(rows[-1])
        while driver.is_alive():
            driver.join(timeout=args.sample_s)
            rows.append(sample(launcher, time.monotonic() - started_s))
            print_row(rows[-1])
        is_idle = wait_idle(launcher)
        rows.append(sample(launcher, time.monotonic() - started_s))
        print_row(rows[-1])
        refused = sum(o.status == 429 for o in outcomes)
        errors = sum(o.error is not None for o in outcomes) - refused
        first, last = rows[0], rows[-1]
        print(f"requests {len(outcomes)}, refused (429) {refused}, other errors {errors}, "
              f"elapsed {(time.monotonic() - started_s) / 60:.1f} min")
        print(f"after the load: instances idle with KV 0: {is_idle}; KV in use "
              f"{last['kv_usage']}; shm files {last['shm_files']} (before launch {shm_before})")
        for name in first["rss_mib"]:
            print(f"  {name}: RSS {first['rss_mib'][name]:.0f} -> {last['rss_mib'][name]:.0f} MiB "
                  f"(max {max(r['rss_mib'][name] for r in rows):.0f}), FDs {first['fds'][name]} -> "
                  f"{last['fds'][name]} (max {max(r['fds'][name] for r in rows)})")
        plot(rows, args.png, f"soak {args.minutes:g} min at {rate_rps:.2f} req/s")
        print(f"curves: {args.png}; load average after: {os.getloadavg()}")
    print(f"shm files after stop: {shm_files()}")


if __name__ == "__main__":
    main()
