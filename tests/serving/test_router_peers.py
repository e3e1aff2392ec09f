"""The router's peers at run time (a plan switch loses no request) and node-affine decode dispatch."""

from __future__ import annotations

import asyncio
import json

import pytest
from serving_helpers import make_settings

from distserve_engine.config import EngineConfig
from distserve_engine.instance.client import LocalInstanceClient
from distserve_engine.instance.decode import DecodeInstance
from distserve_engine.instance.prefill import PrefillInstance
from distserve_engine.request import InstanceLoad, ServeRequest
from distserve_engine.router import Overloaded, Router
from distserve_engine.runner import ModelRunner
from distserve_engine.sampling import SamplingParams
from distserve_engine.server.assembly import http_clients
from distserve_engine.server.peers import PeerWatcher
from distserve_engine.server.settings import Peer
from distserve_engine.transfer import KVFetcher, inprocess


@pytest.fixture
def two_pairs(tiny_llama):
    """Instances of an old plan (pA, dA) and a new one (pB, dB), by name."""
    def runner():
        return ModelRunner(EngineConfig(model=tiny_llama, num_blocks=64))
    instances = {
        "pA": PrefillInstance("pA", runner(), 64).start(),
        "dA": DecodeInstance("dA", runner(), KVFetcher(), 4).start(),
        "pB": PrefillInstance("pB", runner(), 64).start(),
        "dB": DecodeInstance("dB", runner(), KVFetcher(), 4).start(),
    }
    for name in ("pA", "pB"):
        inprocess.register(instances[name])
    yield instances
    for instance in instances.values():
        instance.stop()
    for name in ("pA", "pB"):
        inprocess.unregister(instances[name])


def write_peers(path, tiny_llama, prefill: list[str], decode: list[str]) -> None:
    """The router's settings file with these peers (names of in-process instances)."""
    peers = {"prefill": [f"{n}=local" for n in prefill], "decode": [f"{n}=local" for n in decode]}
    doc = make_settings(tiny_llama, peers=peers).to_dict()
    path.write_text(json.dumps(doc))


def test_peers_changed_while_a_stream_is_in_flight(tiny_llama, two_pairs, tmp_path):
    path = tmp_path / "serve.json"
    write_peers(path, tiny_llama, ["pA"], ["dA"])

    def make_clients(peers):  # the in-process instance of each peer's name
        return {role: [LocalInstanceClient(two_pairs[p.name]) for p in entries]
                for role, entries in peers.items()}

    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompt = two_pairs["pA"].runner.tokenizer.encode("the quick brown fox jumps")

    async def scenario():
        router = Router(*make_clients({"prefill": [Peer("pA", "local")],
                                       "decode": [Peer("dA", "local")]}).values())
        await router.start()
        watcher = PeerWatcher(path, router, make_clients, interval_s=0.05)
        watcher.start()
        stream = router.generate(ServeRequest("old", prompt, params))
        events = [await anext(stream), await anext(stream)]  # prefilled on pA, decoding on dA
        write_peers(path, tiny_llama, ["pB"], ["dB"])
        for _ in range(100):
            if {s.client.name for s in router.slots if not s.is_draining} == {"pB", "dB"}:
                break
            await asyncio.sleep(0.05)
        new = [e async for e in router.generate(ServeRequest("new", prompt, params))]
        events += [e async for e in stream]
        await router.poll()
        names_left = {s.client.name for s in router.slots}
        await watcher.stop()
        await router.stop()
        return events, new, names_left, {t.request_id: t for t in router.timelines}

    events, new, names_left, timelines = asyncio.run(scenario())
    assert all(e.error is None for e in events + new)
    assert sum(len(e.token_ids) for e in events) == 40 and events[-1].is_last
    assert sum(len(e.token_ids) for e in new) == 40
    assert (timelines["old"].prefill_instance, timelines["old"].decode_instance) == ("pA", "dA")
    assert (timelines["new"].prefill_instance, timelines["new"].decode_instance) == ("pB", "dB")
    assert names_left == {"pB", "dB"}  # the old ones dropped once idle


class FakeClient:
    """An instance on a node that answers only load polls."""

    def __init__(self, name: str, role: str, node: str | None = None) -> None:
        self.name, self.role, self.node = name, role, node
        self.url, self.is_draining = None, False

    async def load(self) -> InstanceLoad:
        return InstanceLoad(self.name, self.role)

    async def close(self) -> None:
        pass


def test_draining_peers_get_no_new_requests_and_admission_follows():
    router = Router([FakeClient("p0", "prefill")], [FakeClient("d0", "decode")])
    peers = {"prefill": [Peer("p0", "http://p0:1", "n", draining=True)],
             "decode": [Peer.parse("d0=http://d0:1", "decode", 0)]}
    clients = http_clients(peers)
    assert (clients["prefill"][0].node, clients["prefill"][0].is_draining) == ("n", True)

    async def scenario():
        router.set_peers(clients)
        return [(s.client.name, s.is_draining) for s in router.slots]

    slots = asyncio.run(scenario())
    # p0 and d0 in-process are not the URL clients: both drain; the URL ones join, p0's draining.
    assert slots == [("p0", True), ("p0", True), ("d0", True), ("d0", False)]
    with pytest.raises(Overloaded, match="no healthy prefill"):
        router.admit()
