"""Fixtures of the monitoring tests: the helpers of the serving and analyzer tests (a
free port block, a bounded wait, a real Prometheus process) on the path."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# NOTE: the serving tests' port and wait helpers, and the analyzer tests' Prometheus
# process, are reused from their folders rather than copied.
sys.path.insert(0, str(TESTS / "serving"))
sys.path.insert(0, str(TESTS / "analyzer"))
