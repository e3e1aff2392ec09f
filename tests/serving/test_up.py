"""`distserve up` end to end with the tiny model: plan, launch, serve, Ctrl-C stops all."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import httpx
import pytest
from serving_helpers import wait_until

SPEC = """\
apiVersion: distserve.io/v1alpha1
kind: DistServeDeployment
metadata: {{name: tiny-up}}
spec:
  model: {{name: {path}/config.json, path: {path}, maxModelLen: 256}}
  slo: {{ttftSeconds: 5, tpotSeconds: 1}}
  cluster: {{accelerator: CPU, nodes: 1, gpusPerNode: 2}}
  placement:
    prefill: {{tp: 1, pp: 1, instances: 1}}
    decode: {{tp: 1, pp: 1, instances: 1}}
  planner: {{numRequests: 50}}
  engine: {{device: cpu}}
"""
CLI = "import sys; from distserve.cli import main; sys.exit(main(sys.argv[1:]))"


def free_port_block(size: int = 4) -> int:
    """A port p with p .. p+size-1 free (the router and the instances)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + size < 65535 and all(_is_free(port + i) for i in range(size)):
            return port
    raise RuntimeError("no free port block")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
def test_up_serves_and_ctrl_c_stops_everything(tiny_llama, tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(textwrap.dedent(SPEC.format(path=tiny_llama)))
    port = free_port_block()
    proc = subprocess.Popen([sys.executable, "-c", CLI, "up", "-f", str(spec),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def is_up() -> bool:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(is_up, timeout_s=240)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert all(_is_free(port + i) for i in range(3))  # router and both instances are gone
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
