"""The Prometheus `distserve up --replan` starts when no `--prometheus-url` is given.

Debian's `prometheus` binary (`scripts/setup-dev.sh` installs it) on a free loopback
port, its storage in the launcher's work folder (removed on stop), scraping the router
and every instance each `scrape_interval_s`. The targets are a file (`file_sd_configs`)
that Prometheus watches, so a reshuffle changes what is scraped without a restart.
Engine series keep their own `instance` label (`honor_labels`, as the chart's PodMonitor).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx

DEFAULT_BINARY = "/usr/bin/prometheus"
SCRAPE_INTERVAL_S = 2  # short: a demo's windows are a minute or two
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


class PrometheusNotFound(RuntimeError):
    """No prometheus binary on this machine."""


def find_binary() -> str:
    """The prometheus binary on PATH, else Debian's path; PrometheusNotFound naming the fix."""
    found = shutil.which("prometheus") or (DEFAULT_BINARY if Path(DEFAULT_BINARY).exists() else None)
    if found is None:
        raise PrometheusNotFound("prometheus not found: `apt-get install prometheus` (scripts/"
                                 "setup-dev.sh does), or give --prometheus-url")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalPrometheus:
    """One Prometheus process scraping `targets` (host:port); a context manager."""

    def __init__(self, folder: Path, targets: list[str],
                 scrape_interval_s: int = SCRAPE_INTERVAL_S) -> None:
        self.binary = find_binary()
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.targets_path = folder / "targets.json"
        self.set_targets(targets)
        config = folder / "prometheus.yml"
        config.write_text(
            f"global:\n  scrape_interval: {scrape_interval_s}s\n"
            f"scrape_configs:\n  - job_name: distserve\n    scrape_timeout: {scrape_interval_s}s\n"
            f"    honor_labels: true\n"
            f"    file_sd_configs:\n      - files: [{json.dumps(str(self.targets_path))}]\n"
            f"        refresh_interval: {scrape_interval_s}s\n")
        self.args = [self.binary, f"--config.file={config}",
                     f"--storage.tsdb.path={folder / 'data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        self.process: subprocess.Popen | None = None

    def set_targets(self, targets: list[str]) -> None:
        """Scrape exactly `targets` from now on (the file is replaced atomically)."""
        partial = self.targets_path.with_suffix(".partial")
        partial.write_text(json.dumps([{"targets": sorted(targets)}]))
        os.replace(partial, self.targets_path)

    def __enter__(self) -> LocalPrometheus:
        log = open(self.folder / "prometheus.log", "wb")  # noqa: SIM115 (closed with the process)
        self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        log.close()  # the child holds its own descriptor
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError("prometheus exited: "
                                   + (self.folder / "prometheus.log").read_text()[-2000:])
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"prometheus not ready within {READY_TIMEOUT_S:.0f} s")

    def __exit__(self, *_) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
