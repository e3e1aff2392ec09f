"""`distserve up` started as a shell starts a background job (SIGINT ignored) stops on
SIGINT and removes its work folder; with an API key, the key and the prompts appear in
none of its processes' logs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from serving_helpers import tiny_spec_yaml, wait_until
from test_up import CLI, _is_free, free_port_block

KEY = "sk-local-7f3a9c0d1e2b"
PROMPT = "zebra quartz marmalade"  # words the tiny model's corpus never saw


def ignore_sigint() -> None:
    """What a shell does before it runs a job with `&`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
def test_background_up_stops_on_sigint_and_logs_no_key_or_prompt(tiny_llama, tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(tiny_spec_yaml(tiny_llama, "tiny-up"))
    port = free_port_block()
    env = {**os.environ, "DISTSERVE_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-c", CLI, "up", "-f", str(spec), "--port", str(port),
                             "--no-measure"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env, preexec_fn=ignore_sigint)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(
        line.decode(errors="replace") for line in proc.stdout), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        def is_up() -> bool:
            assert proc.poll() is None, "".join(output)
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(is_up, timeout_s=240)
        body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
        too_long = {"prompt": PROMPT + " x" * 400}  # refused: the error names no prompt text
        r = httpx.post(f"{url}/v1/completions", json=too_long, timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and PROMPT not in r.text
        workdir = Path(re.search(r"work folder (\S+)", "".join(output)).group(1))
        logs = {p.name: p.read_text(errors="replace") for p in workdir.glob("*.log")}
        assert {"router-0.log", "prefill-0.log", "decode-0.log"} <= set(logs)
        metrics = httpx.get(f"{url}/metrics").text
        for name, text in {**logs, "stdout": "".join(output), "metrics": metrics}.items():
            assert KEY not in text and PROMPT not in text, name
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert not workdir.exists()
        assert all(_is_free(port + i) for i in range(3))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
