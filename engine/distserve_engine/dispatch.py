"""Which instance gets a request: the paper's two dispatch decisions, as pure functions.

DistServe section 4.3: a new request goes to the prefill instance with the shortest
queue, counted in prompt tokens sent and not yet prefilled (ties: fewer requests); a
prefilled request goes to the least loaded decode instance (fewest requests, then least
KV), preferring one on its prefill instance's node (Algorithm 2 places them so the KV
moves over the node's fast link) and going elsewhere when none there has room. A
deployment whose network is too slow for KV (low node affinity) keeps a request on its
prefill's node, queued there when every decode instance there is full, and sends it
elsewhere only when the node has no decode instance. A colocated instance (the
baseline) is picked as a prefill one is. Only instances that can take work count:
healthy and not draining.

The router owns the `Slot`s and keeps their counters; these functions only read them.
The rule of room is `policy.has_decode_room`, which the simulator calls too; the
conformance test (`tests/control/test_conformance.py`) holds both dispatches equal.
"""

from __future__ import annotations

from dataclasses import dataclass

from distserve_engine.interface import InstanceClient, InstanceError
from distserve_engine.policy import has_decode_room


class NoInstance(InstanceError):
    """No instance of the role can take a request now (the caller answers 503)."""


@dataclass
class Slot:
    """One instance as the router tracks it."""

    client: InstanceClient
    num_outstanding: int = 0  # requests sent and not finished on it
    num_outstanding_tokens: int = 0  # their prompt tokens
    is_healthy: bool = True
    error: str | None = None  # why it is unhealthy
    is_draining: bool = False  # no new request; in-flight ones finish
    kv_usage: float = 0.0  # from the last load poll

    @property
    def node(self) -> str | None:
        """The node the instance runs on (None: unknown, e.g. in one process)."""
        return self.client.node

    @property
    def can_take(self) -> bool:
        """Whether a new request may go here."""
        return self.is_healthy and not self.is_draining

    def take(self, num_tokens: int) -> None:
        """Count a request sent here."""
        self.num_outstanding += 1
        self.num_outstanding_tokens += num_tokens

    def give_back(self, num_tokens: int) -> None:
        """Count a request finished here."""
        self.num_outstanding -= 1
        self.num_outstanding_tokens -= num_tokens


def pick_prefill(slots: list[Slot], role: str = "prefill") -> Slot:
    """The instance with the shortest queue in prompt tokens (prefill or colocated)."""
    open_slots = [s for s in slots if s.can_take]
    if not open_slots:
        raise NoInstance(f"no healthy {role} instance")
    return min(open_slots, key=lambda s: (s.num_outstanding_tokens, s.num_outstanding))


def has_room(slot: Slot, max_decode_batch: int | None) -> bool:
    """Whether a decode instance can take one more request now (KV and batch size)."""
    return has_decode_room(slot.num_outstanding, slot.kv_usage, max_decode_batch)


def pick_decode(slots: list[Slot], prefill_node: str | None, max_decode_batch: int | None,
                can_cross_nodes: bool = True) -> Slot:
    """The least loaded decode instance with room on the prefill's node, else with room
    anywhere, else any that can take work (it queues the request).

    With `can_cross_nodes` False (low node affinity: the network between nodes is too
    slow for KV), a request stays on its prefill's node: the least loaded there with
    room, else the least loaded there; only a node with no decode instance that can take
    work sends to the others, as above."""
    open_slots = [s for s in slots if s.can_take]
    if not open_slots:
        raise NoInstance("no healthy decode instance")
    local = [s for s in open_slots if s.node == prefill_node]
    if not can_cross_nodes and local:
        open_slots = local
    roomy = [s for s in open_slots if has_room(s, max_decode_batch)]
    roomy_local = [s for s in roomy if s.node == prefill_node]
    return min(roomy_local or roomy or open_slots, key=lambda s: (s.num_outstanding, s.kv_usage))
