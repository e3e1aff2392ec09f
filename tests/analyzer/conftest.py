"""Fixtures of the analyzer tests: a real router over the tiny model, a real Prometheus."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# NOTE: the tiny checkpoint and the uvicorn thread are the serving tests' helpers;
# their folder is put on the path rather than copying them.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Path of the tiny random Llama checkpoint (built once per session)."""
    from serving_helpers import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
