"""Fixtures of the monitoring tests: the tiny model, and the helpers of the serving and
analyzer tests (a uvicorn thread, settings, a real Prometheus process) on the path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
# NOTE: the serving tests' tiny checkpoint and server thread, and the analyzer tests'
# Prometheus process, are reused from their folders rather than copied.
sys.path.insert(0, str(TESTS / "serving"))
sys.path.insert(0, str(TESTS / "analyzer"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Path of the tiny random Llama checkpoint (built once per session)."""
    from serving_helpers import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
