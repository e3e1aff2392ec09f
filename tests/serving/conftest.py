"""Fixtures of the serving tests: a tiny random Llama checkpoint with a real tokenizer."""

from __future__ import annotations

import pytest
from serving_helpers import ServerThread, build_tiny_llama, make_settings


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """Path of the tiny random Llama checkpoint."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def deployment(tiny_llama):
    """Router + 1 prefill + 1 decode in this process, served over HTTP; yields (url, instances)."""
    from distserve_engine.server import assembly

    settings = make_settings(tiny_llama)
    router, instances, runner = assembly.build_in_process(settings)
    app = assembly.build_frontend_app(settings, router, runner.tokenizer, runner.max_model_len)
    with ServerThread(app) as server:
        yield server.url, {i.role: i for i in instances}
    for instance in instances:
        instance.stop()
