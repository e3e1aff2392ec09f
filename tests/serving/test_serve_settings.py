"""The serving settings document: one typed representation, read and written the same way
by `distserve up`, the operator and every process; a bad document is an error naming the
field. Built where torch is not installed (the operator's image)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from distserve.local.settings import serve_settings
from distserve.spec import load_manifest
from distserve_engine.config import EngineConfig
from distserve_engine.server.settings import Parallelism, Peer, PlanInfo, ServeSettings, Slo

DOC = {
    "engine": {"model": "/models/x", "device": "cpu", "max_model_len": 256},
    "deployment": "d", "model_name": "m",
    "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
    "instances": {"prefill": 2, "decode": 1},
    "peers": {"prefill": ["http://p0:8001", "p1=http://p1:8001"],
              "decode": [{"name": "d0", "url": "http://d0:8001", "node": "n1", "draining": True}]},
    "parallel": {"prefill-0": {"tp": 2, "pp": 1}, "prefill-1": {"tp": 1, "pp": 2}},
    "plan": {"id": "abc", "prefill": "tp2pp1x2", "decode": "tp1pp1x1"},
}


def test_every_part_is_read_into_its_type_and_written_back_the_same():
    settings = ServeSettings.from_dict(DOC)
    assert settings.engine == EngineConfig(model="/models/x", device="cpu", max_model_len=256)
    assert settings.slo == Slo(2.0, 0.1)
    assert settings.peers["prefill"] == [Peer("prefill-0", "http://p0:8001"),
                                         Peer("p1", "http://p1:8001")]
    assert settings.peers["decode"] == [Peer("d0", "http://d0:8001", "n1", draining=True)]
    assert settings.parallel_of("prefill", "prefill-0") == Parallelism(2, 1)
    assert settings.parallel_of("prefill", "prefill-1") == Parallelism(1, 2)
    assert settings.plan == PlanInfo("abc", prefill="tp2pp1x2", decode="tp1pp1x1")
    assert settings.can_decode_across_nodes  # unless the document says otherwise
    again = ServeSettings.from_dict(json.loads(json.dumps(settings.to_dict())))
    assert again == settings


def test_an_instance_parallel_does_not_name_is_an_error_naming_it_and_the_names_present():
    settings = ServeSettings.from_dict({**DOC, "parallel": {
        "prefill-0": {"tp": 2}, "prefill": {"tp": 4}}})  # a role's name is no default
    with pytest.raises(ValueError, match=r"parallel has no entry for instance 'prefill-1' "
                                         r"\(a prefill instance\); it has \['prefill', 'prefill-0'\]"):
        settings.parallel_of("prefill", "prefill-1")
    unnamed = ServeSettings.from_dict({**DOC, "parallel": {}})  # no parallelism given
    assert unnamed.parallel_of("decode", "decode-0") == Parallelism(1, 1)


@pytest.mark.parametrize(("change", "message"), [
    ({"parallel": {"prefill-0": {"tp": 0}}}, r"parallel\.prefill-0\.tp must be an integer >= 1, got 0"),
    ({"parallel": {"decode-1": {"pp": "2"}}}, r"parallel\.decode-1\.pp must be an integer >= 1"),
    ({"parallel": {"prefill-0": {"tp": 2, "dp": 2}}}, r"parallel\.prefill-0 has unknown keys \['dp'\]"),
    ({"parallel": [{"tp": 2}]}, r"parallel must be an object keyed by instance name"),
    ({"peers": {"decode": [{"name": "d0"}]}}, r"peers\.decode\[0\] needs a url"),
    ({"slo": {"ttft_s": -1}}, r"slo\.ttft_s must be a number > 0, got -1"),
    ({"slo": {"attainment": 1.5}}, r"slo\.attainment must be a number in \(0, 1\], got 1\.5"),
    ({"slo": {"ttft": 1}}, r"slo has unknown keys \['ttft'\]"),
    ({"instances": {"decode": -1}}, r"instances\.decode must be an integer >= 0, got -1"),
    ({"engine": {"model": "/m", "blocksize": 8}}, r"engine has unknown keys \['blocksize'\]"),
    ({"engine": {"model": "/m", "device": "tpu"}}, r"device: expected 'cpu' or 'cuda', got 'tpu'"),
    ({"max_batch": 4}, r"the document has unknown keys \['max_batch'\]"),
    ({"can_decode_across_nodes": "no"}, r"can_decode_across_nodes must be true or false, got 'no'"),
])
def test_a_bad_document_is_an_error_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        ServeSettings.from_dict({**DOC, **change})


def test_a_document_without_engine_names_it():
    doc = {k: v for k, v in DOC.items() if k != "engine"}
    with pytest.raises(ValueError, match="engine is required"):
        ServeSettings.from_dict(doc)


def test_the_local_builder_gives_the_spec_s_engine_slos_and_shape():
    spec = load_manifest("examples/local.yaml").spec
    settings = serve_settings(spec, {"prefill": 1, "decode": 1}, "local", "/models/smollm2",
                              {"prefill": Parallelism(1, 1), "decode": Parallelism(1, 1)})
    assert settings.engine.model == "/models/smollm2" and settings.engine.device == "cpu"
    assert settings.slo == Slo(spec.slo.ttft_seconds, spec.slo.tpot_seconds, spec.slo.attainment)
    assert ServeSettings.from_dict(settings.to_dict()) == settings


def test_the_settings_and_the_operator_import_without_torch():
    code = ("import sys, distserve_engine.server.settings, distserve.local.settings, "
            "distserve.k8s.handlers; sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


class FakeClient:
    """Only what the router reads of an instance client before it serves."""

    def __init__(self, name: str, node: str) -> None:
        self.name, self.url, self.node, self.is_draining = name, f"http://{name}:8001", node, False


def test_the_router_keeps_decode_on_node_as_its_settings_say_and_a_reload_changes_it():
    from distserve_engine.server.assembly import build_router
    from distserve_engine.server.peers import apply_settings

    clients = {"prefill": [FakeClient("p0", "n1")],
               "decode": [FakeClient("d0", "n1"), FakeClient("d1", "n2")]}
    router = build_router(ServeSettings.from_dict({**DOC, "can_decode_across_nodes": False}),
                          clients, None)
    assert router.can_decode_across_nodes is False
    apply_settings(router, ServeSettings.from_dict(DOC), lambda peers: clients)
    assert router.can_decode_across_nodes is True
