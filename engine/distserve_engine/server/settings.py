"""The serving settings document (`--config FILE`): JSON, written by the launcher or operator.

    {"deployment": "local", "model_name": "HuggingFaceTB/SmolLM2-135M-Instruct",
     "engine": {"model": "/path", "device": "cpu", "max_model_len": 2048, ...},  # EngineConfig
     "max_prefill_tokens": 512, "max_decode_batch": 32, "max_waiting_requests": 128,
     "max_inflight_requests": 256, "admit_by_ttft": false, "max_request_body_bytes": 2097152,
     "can_decode_across_nodes": true,  # false: decode stays on the prefill's node
     "default_max_tokens": 256, "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
     "instances": {"prefill": 1, "decode": 1, "colocated": 0},   # for --role all
     "peers": {"prefill": ["http://p0:8001"], "decode": [...]},  # for --role router
     "parallel": {"prefill-0": {"tp": 2, "pp": 1}},  # ranks of each instance, by name
     "plan": {"id": "3f2a9c0d1e", "predicted_attainment": 0.93,   # optional: the plan
              "predicted_goodput_rps": 4.2,                         # served, for metrics
              "prefill": "tp2pp1x1", "decode": "tp1pp1x2"}}

`parallel` gives each instance its tp x pp, keyed by the name the process is started
with (`--instance`): the launcher and the operator write one entry per instance, so the
instances of one role may differ (a mixed plan). A `parallel` that names instances must
name every instance started (an instance it lacks is an error naming the instance and
the names it has); an empty one runs every instance on one rank (hand-written documents).

A peer is `URL`, `NAME=URL` or `{"name", "url", "node", "draining"}`. A router reading
its peers from this file re-reads it while it runs (`server/peers.py`).

`ServeSettings` is the document's one representation: the launcher (`distserve up`) and
the operator build it, processes read it, and each part is typed (`EngineConfig`,
`Slo`, `Peer`, `Parallelism`, `PlanInfo`), checked when the document is read. This
module imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from distserve_engine.config import EngineConfig

ROLES = ("prefill", "decode", "colocated")


def _check_keys(cls: type, doc: Any, where: str) -> dict[str, Any]:
    """`doc` as a dict of `cls`'s fields; anything else is an error naming `where`."""
    if not isinstance(doc, dict):
        raise ValueError(f"serve settings: {where} must be an object, got {doc!r}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ValueError(f"serve settings: {where} has unknown keys {unknown}; expected some of "
                         f"{sorted(known)}")
    return doc


def _check_roles(doc: Any, where: str) -> dict[str, Any]:
    """A role-keyed object; a key that is no role is an error naming it."""
    if not isinstance(doc, dict):
        raise ValueError(f"serve settings: {where} must be an object keyed by role, got {doc!r}")
    bad = sorted(set(doc) - set(ROLES))
    if bad:
        raise ValueError(f"serve settings: {where} has unknown roles {bad}; expected some of "
                         f"{list(ROLES)}")
    return doc


@dataclass(frozen=True)
class PlanInfo:
    """The plan a deployment serves under, with what the planner predicted for it."""

    id: str  # Plan.plan_id
    predicted_attainment: float | None = None  # SLO attainment at the predicted goodput
    predicted_goodput_rps: float | None = None
    prefill: str = ""  # the phase's shape, `tp<TP>pp<PP>x<instances>`
    decode: str = ""

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> PlanInfo:
        """Read `plan`; unknown keys or a missing id are an error naming them."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(doc) - known)
        if unknown or not isinstance(doc.get("id"), str) or not doc["id"]:
            raise ValueError(f"serve settings: plan needs a non-empty string id and only keys "
                             f"{sorted(known)}; got {doc!r}")
        return cls(**doc)


@dataclass(frozen=True)
class Slo:
    """The deployment's latency targets, in seconds (None: no target), and the share of
    requests that must meet them (the attainment objective the alerts' burn rates use)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    attainment: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or value <= 0):
                raise ValueError(f"serve settings: slo.{name} must be a number > 0, got {value!r}")
        value = self.attainment
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value <= 1):
            raise ValueError(f"serve settings: slo.attainment must be a number in (0, 1], got {value!r}")

    @classmethod
    def from_dict(cls, doc: Any) -> Slo:
        return cls(**_check_keys(cls, doc, "slo"))


@dataclass(frozen=True)
class Parallelism:
    """Ranks of one instance: tensor-parallel degree x pipeline stages."""

    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"serve settings: parallel.{name} must be an integer >= 1, "
                                 f"got {value!r}")

    @property
    def num_ranks(self) -> int:
        return self.tp * self.pp

    @classmethod
    def from_dict(cls, doc: Any, where: str = "parallel.<instance>") -> Parallelism:
        doc = _check_keys(cls, doc, where)
        for name in ("tp", "pp"):
            value = doc.get(name, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"serve settings: {where}.{name} must be an integer >= 1, "
                                 f"got {value!r}")
        return cls(**doc)


@dataclass(frozen=True)
class Peer:
    """One instance the router sends work to."""

    name: str
    url: str
    node: str | None = None  # the node it runs on; the router prefers same-node pairs
    draining: bool = False  # takes no new request; in-flight ones finish

    @classmethod
    def parse(cls, entry: Any, role: str, index: int) -> Peer:
        """A peer from `URL`, `NAME=URL` or `{"name", "url", "node", "draining"}`."""
        if isinstance(entry, Peer):
            return entry
        if isinstance(entry, str):
            name, _, url = entry.partition("=") if "=" in entry else (f"{role}-{index}", "", entry)
            entry = {"name": name, "url": url}
        doc = dict(_check_keys(cls, entry, f"peers.{role}[{index}]"))
        if not isinstance(doc.get("url"), str) or not doc["url"]:
            raise ValueError(f"serve settings: peers.{role}[{index}] needs a url, got {entry!r}")
        doc["name"] = doc.get("name") or f"{role}-{index}"
        doc["draining"] = bool(doc.get("draining", False))
        return cls(**doc)


def _read_parallel(doc: Any) -> dict[str, Parallelism]:
    """`parallel`: instance name -> Parallelism; errors name the entry."""
    if not isinstance(doc, dict):
        raise ValueError(f"serve settings: parallel must be an object keyed by instance name, "
                         f"got {doc!r}")
    out = {}
    for name, entry in doc.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"serve settings: parallel has a key {name!r}; expected instance names")
        out[name] = entry if isinstance(entry, Parallelism) else Parallelism.from_dict(
            entry, f"parallel.{name}")
    return out


@dataclass
class ServeSettings:
    """How one deployment serves: the engine, batching bounds, SLOs, peers."""

    engine: EngineConfig  # of every instance
    deployment: str = "distserve"
    model_name: str = "model"
    max_prefill_tokens: int = 512  # Lm: prefill batches fill up to this many tokens
    max_decode_batch: int = 64  # most sequences in one decode batch
    max_waiting_requests: int = 128  # router refuses (429) beyond this many waiting
    max_inflight_requests: int | None = None  # 429 beyond; None: waiting + 2 decode batches each
    admit_by_ttft: bool = False  # 429 at once when the queue ahead would miss the TTFT SLO
    # a decode instance on another node may take a request whose prefill's node has one
    # (False under low node affinity: KV crosses only where the node has no decode)
    can_decode_across_nodes: bool = True
    max_request_body_bytes: int = 2 * 1024 * 1024  # 413 beyond
    default_max_tokens: int | None = 256  # chat output limit when the client gives none
    slo: Slo = field(default_factory=Slo)
    instances: dict[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    peers: dict[str, list[Peer]] = field(default_factory=dict)  # role -> instances to route to
    # instance name -> ranks of that instance (empty: every instance on one rank)
    parallel: dict[str, Parallelism] = field(default_factory=dict)
    plan: PlanInfo | None = None  # the plan served under (metrics only); None without a plan

    def __post_init__(self) -> None:
        # Parts given as their JSON form are read into their types, so there is one
        # representation whichever way the settings were built.
        if isinstance(self.engine, dict):
            self.engine = EngineConfig(**_check_keys(EngineConfig, self.engine, "engine"))
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"serve settings: engine must be an object, got {self.engine!r}")
        if not isinstance(self.slo, Slo):
            self.slo = Slo.from_dict(self.slo)
        if isinstance(self.plan, dict):
            self.plan = PlanInfo.from_dict(self.plan)
        self.instances = dict(_check_roles(self.instances, "instances"))
        for role, count in self.instances.items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"serve settings: instances.{role} must be an integer >= 0, "
                                 f"got {count!r}")
        self.peers = {role: [Peer.parse(entry, role, i) for i, entry in enumerate(entries)]
                      for role, entries in _check_roles(self.peers, "peers").items()}
        self.parallel = _read_parallel(self.parallel)
        if not isinstance(self.max_request_body_bytes, int) or self.max_request_body_bytes < 1:
            raise ValueError(f"serve settings: max_request_body_bytes must be an integer >= 1, "
                             f"got {self.max_request_body_bytes!r}")
        if not isinstance(self.can_decode_across_nodes, bool):
            raise ValueError(f"serve settings: can_decode_across_nodes must be true or false, "
                             f"got {self.can_decode_across_nodes!r}")
        if self.admit_by_ttft and self.ttft_slo_s is None:
            raise ValueError("serve settings: admit_by_ttft needs slo.ttft_s")

    def parallel_of(self, role: str, instance_name: str) -> Parallelism:
        """tp x pp of the `role` instance named `instance_name`: its entry (1 x 1 when
        `parallel` is empty); a ValueError naming it and the names present when absent."""
        if not self.parallel:
            return Parallelism()
        if instance_name not in self.parallel:
            raise ValueError(f"serve settings: parallel has no entry for instance "
                             f"{instance_name!r} (a {role} instance); it has "
                             f"{sorted(self.parallel)}")
        return self.parallel[instance_name]

    @property
    def ttft_slo_s(self) -> float | None:
        return self.slo.ttft_s

    @property
    def tpot_slo_s(self) -> float | None:
        return self.slo.tpot_s

    def export_slo(self, metrics: Any) -> None:
        """Export the objectives on `metrics` (a `ServingMetrics`)."""
        metrics.set_slo(self.slo.ttft_s, self.slo.tpot_s, self.slo.attainment)

    def plan_metrics(self) -> dict[str, Any]:
        """The arguments of `ServingMetrics.set_plan` for this plan."""
        if self.plan is None:
            return {"plan_id": None}
        return {"plan_id": self.plan.id, "prefill": self.plan.prefill, "decode": self.plan.decode,
                "predicted_attainment": self.plan.predicted_attainment,
                "predicted_goodput_rps": self.plan.predicted_goodput_rps}

    def to_dict(self) -> dict[str, Any]:
        """The JSON document."""
        return asdict(self)

    def write(self, path: str | Path) -> None:
        """Write the JSON document to `path`."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ServeSettings:
        """Read the document; unknown keys are an error naming them."""
        doc = _check_keys(cls, doc, "the document")
        if "engine" not in doc:
            raise ValueError("serve settings: engine is required (the EngineConfig fields)")
        return cls(**doc)

    @classmethod
    def load(cls, path: str | Path) -> ServeSettings:
        """Read a JSON settings file."""
        return cls.from_dict(json.loads(Path(path).read_text()))
