"""The paper's dispatch decisions, read off the router's counters (pure functions)."""

from __future__ import annotations

import pytest

from distserve_engine.dispatch import NoInstance, Slot, has_room, pick_decode, pick_prefill


class Client:
    """Only what dispatch reads of an instance: its name and node."""

    def __init__(self, name: str, node: str | None = None) -> None:
        self.name, self.node = name, node


def slots(*names: str, node: str | None = None) -> list[Slot]:
    return [Slot(Client(name, node)) for name in names]


def test_prefill_goes_to_the_shortest_queue_in_tokens_then_requests():
    p0, p1, p2 = slots("p0", "p1", "p2")
    p0.take(500)
    p1.take(100)
    p1.take(100)
    p2.take(300)
    assert pick_prefill([p0, p1, p2]) is p1  # fewest queued tokens
    p2.give_back(300)
    p2.take(200)
    assert pick_prefill([p0, p1, p2]) is p2  # tokens tie at 200: one request beats two
    p2.is_healthy = False
    assert pick_prefill([p0, p1, p2]) is p1  # never an unhealthy one
    p1.is_draining = True
    assert pick_prefill([p0, p1, p2]) is p0  # nor a draining one
    p0.is_healthy = False
    with pytest.raises(NoInstance, match="no healthy colocated instance"):
        pick_prefill([p0, p1, p2], "colocated")


def test_decode_prefers_the_prefill_node_while_it_has_room():
    (remote,) = slots("d-b", node="node-b")
    (local,) = slots("d-a", node="node-a")
    local.take(10)
    local.take(10)
    assert pick_decode([remote, local], "node-a", max_decode_batch=3) is local  # busier, but local
    local.take(10)
    assert not has_room(local, 3)
    assert pick_decode([remote, local], "node-a", max_decode_batch=3) is remote  # batch full
    local.give_back(10)
    local.kv_usage = 0.95
    assert pick_decode([remote, local], "node-a", max_decode_batch=3) is remote  # KV full
    remote.is_healthy = False
    assert pick_decode([remote, local], "node-a", max_decode_batch=3) is local  # anything healthy
    local.is_healthy = False
    with pytest.raises(NoInstance, match="no healthy decode instance"):
        pick_decode([remote, local], "node-a", max_decode_batch=3)


def test_decode_kept_on_the_prefill_node_queues_there_and_leaves_only_an_empty_node():
    (remote,) = slots("d-b", node="node-b")
    local_0, local_1 = slots("d-a0", "d-a1", node="node-a")
    for slot in (local_0, local_1):
        slot.take(10)
        slot.take(10)
    local_1.take(10)
    local_0.kv_usage = 0.95
    # local_0 has no room (KV), local_1 has (2 of 4): the roomy one, though busier
    assert pick_decode([remote, local_0, local_1], "node-a", 4, can_cross_nodes=False) is local_1
    local_1.take(10)  # now full too: the request queues on the least loaded of the node
    assert pick_decode([remote, local_0, local_1], "node-a", 4, can_cross_nodes=False) is local_0
    assert pick_decode([remote, local_0, local_1], "node-a", 4) is remote  # crossing allowed
    local_0.is_draining, local_1.is_healthy = True, False  # none on the node can take it
    assert pick_decode([remote, local_0, local_1], "node-a", 4, can_cross_nodes=False) is remote
    # every node unknown (one machine): the node is everyone's, as with crossing allowed
    d0, d1 = slots("d0", "d1")
    d0.take(5)
    assert pick_decode([d0, d1], None, None, can_cross_nodes=False) is d1


def test_decode_elsewhere_goes_to_fewest_requests_then_least_kv():
    d0, d1, d2 = slots("d0", "d1", "d2")
    d0.take(10)
    d0.take(10)
    d1.take(1000)
    d2.take(5)
    d1.kv_usage, d2.kv_usage = 0.5, 0.2
    assert pick_decode([d0, d1, d2], None, max_decode_batch=None) is d2  # 1 request, less KV
    d2.is_draining = True
    assert pick_decode([d0, d1, d2], None, max_decode_batch=None) is d1
