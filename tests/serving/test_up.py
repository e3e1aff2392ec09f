"""`distserve up` end to end with the tiny model: plan, launch, serve, Ctrl-C stops all.

Once with plain processes, once with Ray actors (skipped where Ray cannot start).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serving_helpers import tiny_spec_yaml, wait_until

CLI = "import sys; from distserve.cli import main; sys.exit(main(sys.argv[1:]))"
RAY_PROBE = ("import os; os.environ.setdefault('RAY_AUTH_MODE', 'disabled'); import ray; "
             "ray.init(num_cpus=2, include_dashboard=False); ray.shutdown()")


def skip_unless_ray_starts() -> None:
    """Skip (with the reason) where Ray is missing or cannot start a local cluster."""
    pytest.importorskip("ray")
    try:
        probe = subprocess.run([sys.executable, "-c", RAY_PROBE], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.skip("Ray did not start a local cluster within 120 s on this machine")
    if probe.returncode != 0:
        pytest.skip(f"Ray cannot start on this machine: {probe.stderr.strip().splitlines()[-1:]}")


def ray_actor_pids() -> set[int]:
    """Processes running a DistServe server actor."""
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::ServerActor"):
                    pids.add(int(entry))
        except (OSError, ValueError):
            continue
    return pids


def free_port_block(size: int = 4) -> int:
    """A port p with p .. p+size-1 free to listen on (the router and the instances).

    Drawn below the kernel's ephemeral range, from which outgoing connections take their
    local ports: a port drawn there can be taken by a client's connection before the
    server binds it ("address already in use")."""
    low_ephemeral = 32768
    try:
        low_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    draw = random.Random(f"{os.getpid()}-{time.monotonic_ns()}")
    for _ in range(200):
        port = draw.randrange(10000, low_ephemeral - size)
        if all(_can_bind(port + i) for i in range(size)):
            return port
    raise RuntimeError("no free port block")


def _can_bind(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return _is_free(port)


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["process", "ray"])
def test_up_serves_and_ctrl_c_stops_everything(tiny_llama, tmp_path, backend):
    if backend == "ray":
        skip_unless_ray_starts()
    actors_before = ray_actor_pids()
    spec = tmp_path / "tiny.yaml"
    spec.write_text(tiny_spec_yaml(tiny_llama, "tiny-up"))
    port = free_port_block()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    # --no-measure: this test is about serving; test_up_profile.py measures and caches.
    # The process backend also starts a Prometheus (`--prometheus`) where Debian's package is.
    with_prometheus = backend == "process" and shutil.which("prometheus") is not None
    proc = subprocess.Popen([sys.executable, "-c", CLI, "up", "-f", str(spec), "--port", str(port),
                             "--backend", backend, "--no-measure",
                             *(["--prometheus"] if with_prometheus else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, b"")), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        def is_up() -> bool:
            assert proc.poll() is None, b"".join(lines).decode()
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(is_up, timeout_s=240)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        if with_prometheus:
            assert wait_until(lambda: any(line.startswith(b"Prometheus at ") for line in lines),
                              timeout_s=60), b"".join(lines).decode()
            prometheus_url = _printed_prometheus_url(lines)
            assert wait_until(lambda: _scraped_targets(prometheus_url) == 3, timeout_s=60)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        reader.join(timeout=10)
        log = b"".join(lines).decode()
        assert "plan: 1 prefill + 1 decode" in log, log  # the planner read model.name's config.json
        assert all(_is_free(port + i) for i in range(3))  # router and both instances are gone
        assert wait_until(lambda: ray_actor_pids() <= actors_before, timeout_s=30)  # no actor left
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _printed_prometheus_url(lines: list[bytes]) -> str:
    """The URL `distserve up --prometheus` printed."""
    found = [line.decode() for line in lines if line.startswith(b"Prometheus at ")]
    assert found, b"".join(lines).decode()
    return found[0].split()[2].rstrip(",")


def _scraped_targets(prometheus_url: str) -> int:
    """How many targets Prometheus scrapes successfully (router and instances)."""
    try:
        doc = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": "up == 1"}, timeout=5).json()
    except httpx.HTTPError:
        return 0
    return len(doc["data"]["result"])
