"""The kind end-to-end run (e2e/run.sh), skipped where Docker or kind is missing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _missing() -> str | None:
    """Why the end-to-end run cannot happen here, or None."""
    for tool in ("docker", "kind", "kubectl"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return "the docker client cannot reach a Docker engine"
    return None


@pytest.mark.e2e
@pytest.mark.slow
def test_kind_cluster_serves_an_openai_request():
    reason = _missing()
    if reason:
        pytest.skip(f"e2e needs Docker and kind: {reason}")
    run = subprocess.run([str(ROOT / "e2e" / "run.sh")], cwd=ROOT, capture_output=True,
                         text=True, timeout=3600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "e2e passed" in run.stderr
