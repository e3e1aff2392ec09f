"""Liveness: an instance whose engine thread is dead or stuck answers 503 on /livez, so
kubelet restarts its pod; a busy but moving one, and the router, answer 200."""

from __future__ import annotations

import threading

from fastapi.testclient import TestClient
from serving_helpers import wait_until

from distserve_engine.instance.loop import InstanceLoop
from distserve_engine.server.instance_app import build_instance_app
from distserve_engine.server.openai_app import build_openai_app


class StuckLoop(InstanceLoop):
    """An instance whose one batch blocks until released (a hung collective)."""

    role = "decode"

    def __init__(self) -> None:
        super().__init__("decode-0", runner=None)
        self.release = threading.Event()
        self.entered = threading.Event()
        self.has_work = False

    def step(self) -> None:
        self.entered.set()
        self.release.wait(timeout=30)
        self.has_work = False

    def _has_work(self) -> bool:
        return self.has_work

    def _fail_all(self, error: str) -> None:
        pass


def test_a_stuck_batch_fails_liveness_until_it_moves_again():
    loop = StuckLoop().start()
    try:
        assert loop.is_live(stall_limit_s=0.05)
        loop.post(lambda: setattr(loop, "has_work", True))
        assert loop.entered.wait(5)
        assert wait_until(lambda: not loop.is_live(stall_limit_s=0.05), timeout_s=5)
        assert loop.is_live(stall_limit_s=60)  # a long batch is not yet a hung one
        loop.release.set()
        assert wait_until(lambda: loop.is_live(stall_limit_s=0.05), timeout_s=5)
    finally:
        loop.release.set()
        loop.stop()


def test_livez_answers_503_when_the_instance_died():
    loop = StuckLoop().start()
    client = TestClient(build_instance_app(loop))
    try:
        assert client.get("/livez").status_code == 200
        loop.kill("device lost")
        assert wait_until(lambda: client.get("/livez").status_code == 503, timeout_s=5)
        assert "device lost" in client.get("/livez").json()["error"]
    finally:
        loop.stop()


def test_router_livez_does_not_depend_on_instances():
    client = TestClient(build_openai_app(frontend=None, metrics=None))
    assert client.get("/livez").json() == {"live": True}
