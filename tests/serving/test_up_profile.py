"""`distserve up` with the tiny model: this machine's profile is measured on the first run
and read from the cache on the next, `--profile FILE` overrides it, the printed plan names
the profile, and the work folder is gone after every way of stopping.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from serving_helpers import make_settings, tiny_spec_yaml, wait_until
from test_up import CLI, free_port_block

DEMO = ["--demo", "--rate", "2", "--duration", "2"]


class Up:
    """One `distserve up` process with its own cache and temporary folders."""

    def __init__(self, tmp_path: Path, spec: Path, *flags: str) -> None:
        self.port = free_port_block()
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "TMPDIR": str(tmp_path / "tmp")}
        (tmp_path / "tmp").mkdir(exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CLI, "up", "-f", str(spec), "--port", str(self.port), *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)

    def finish(self, timeout_s: float = 400) -> tuple[int, str]:
        """Wait for the exit; (exit code, everything it printed)."""
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode, out

    def is_serving(self) -> bool:
        assert self.proc.poll() is None, self.proc.stdout.read()
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


def profile_line(log: str) -> str:
    (line,) = [line for line in log.splitlines() if line.startswith("profile: ")]
    return line


def work_folder(log: str) -> Path:
    return Path(re.search(r"^work folder (\S+) ", log, re.M).group(1))


@pytest.mark.slow
def test_up_measures_once_then_reads_the_cache_and_profile_overrides(tiny_llama, tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(tiny_spec_yaml(tiny_llama, "tiny-profile", "numRequests: 50, maxPrefillTokens: 64, maxDecodeBatch: 4"))

    # First run: measured here, with progress lines, then cached; the demo ends normally.
    code, log = Up(tmp_path, spec, *DEMO).finish()
    assert code == 0, log
    assert "measuring this machine's latency profile" in log
    assert "timed round 1 of 3" in log
    (cached,) = (tmp_path / "cache" / "distserve" / "profiles").glob("*.json")
    assert profile_line(log).startswith(f"profile: {cached} (measured just now on this machine: ")
    assert f"predicted with profile {cached} (measured just now" in log  # under the demo's report
    assert "simulated with these factors: attainment" in log
    assert re.search(r"the speed's drift over the demo: prefill [\d.]+% per 30 s window", log)
    assert re.search(r"replaying the demo's speed as it moved \(prefill x[\d.]+, decode x[\d.]+.*; "
                     r"prefill x[\d.]+-[\d.]+ over \d+ windows? of 10 s, decode .*\): attainment", log)
    assert f"latency: profile {cached.name}" in log  # the planner read it
    doc = json.loads(cached.read_text())
    assert doc["device"]["threads"] == 1 and doc["device"]["cpu_model"] in profile_line(log)
    assert not work_folder(log).exists()
    assert list((tmp_path / "tmp").glob("distserve-up-*")) == []

    # Second run: the cache is read, nothing measured; SIGTERM stops it.
    up = Up(tmp_path, spec)
    assert wait_until(up.is_serving, timeout_s=240)
    up.proc.send_signal(signal.SIGTERM)
    code, log = up.finish(60)
    assert code == 0, log
    assert "measuring" not in log
    assert profile_line(log).startswith(f"profile: {cached} (cached; measured on ")
    assert not work_folder(log).exists()

    # --profile wins over the cache.
    given = tmp_path / "given.json"
    shutil.copy(cached, given)
    code, log = Up(tmp_path, spec, "--profile", str(given), *DEMO).finish()
    assert code == 0, log
    assert profile_line(log).startswith(f"profile: {given} (given by --profile; measured on ")
    assert "latency: profile given.json" in log
    assert not work_folder(log).exists()


def test_a_process_that_fails_to_start_leaves_no_work_folder(tmp_path):
    from distserve.local.launcher import LaunchError, LocalLauncher

    settings = make_settings(str(tmp_path / "no-model-here"))
    launcher = LocalLauncher(settings, port=free_port_block())
    assert launcher.workdir.is_dir()
    with pytest.raises(LaunchError, match="exited while starting"):
        with launcher:
            pass
    assert not launcher.workdir.exists()
