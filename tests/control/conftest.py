"""Fixtures of the control-plane tests (factories live in sim_factories.py)."""

from __future__ import annotations

import pytest
from sim_factories import make_instance, make_trace


@pytest.fixture
def instance_factory():
    return make_instance


@pytest.fixture
def trace_factory():
    return make_trace
