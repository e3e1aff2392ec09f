"""A real Prometheus for the analyzer tests: a plain process on a free loopback port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
SCRAPE_INTERVAL_S = 1
READY_TIMEOUT_S = 60.0


def free_port() -> int:
    """A port nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_prometheus() -> str:
    """The binary, or skip the test saying how to get it."""
    if not Path(PROMETHEUS).exists():
        pytest.skip("prometheus binary not found: apt-get install prometheus (scripts/setup-dev.sh does)")
    return PROMETHEUS


class PrometheusProcess:
    """Prometheus scraping `targets` (host:port) every second, storing under `folder`;
    optionally evaluating `rule_files` every second, adding `labels` to every series and
    keeping the targets' own `instance` labels (`honor_labels`, as the chart's PodMonitor)."""

    def __init__(self, targets: list[str], folder: Path, rule_files: tuple[Path, ...] = (),
                 labels: dict[str, str] | None = None, honor_labels: bool = False) -> None:
        self.binary = require_prometheus()
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = folder / "prometheus.yml"
        config.write_text(
            f"global:\n  scrape_interval: {SCRAPE_INTERVAL_S}s\n  evaluation_interval: {SCRAPE_INTERVAL_S}s\n"
            f"scrape_configs:\n  - job_name: distserve\n    scrape_timeout: {SCRAPE_INTERVAL_S}s\n"
            f"    honor_labels: {str(honor_labels).lower()}\n"
            f"    static_configs:\n      - targets: {targets!r}\n        labels: {labels or {}!r}\n"
            f"rule_files: {[str(f) for f in rule_files]!r}\n")
        self.args = [self.binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> PrometheusProcess:
        log = open(self.folder / "prometheus.log", "wb")  # noqa: SIM115 (closed with the process)
        self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.folder / 'prometheus.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"prometheus not ready within {READY_TIMEOUT_S} s")

    def wait_for_scrapes(self, num: int = 2, timeout_s: float = 30.0) -> None:
        """Until every target was scraped `num` times successfully."""
        deadline = time.monotonic() + timeout_s
        query = f"min(count_over_time(up[{10 * SCRAPE_INTERVAL_S}s]) * up)"
        while time.monotonic() < deadline:
            result = httpx.get(f"{self.url}/api/v1/query", params={"query": query}, timeout=2).json()
            values = result["data"]["result"]
            if values and float(values[0]["value"][1]) >= num:
                return
            time.sleep(0.5)
        raise RuntimeError("prometheus did not scrape the targets in time")

    def __exit__(self, *_) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
