"""Latency models: profile formulas, the analytic model against the profile, KV capacity, Lm."""

import json

import pytest

from distserve.latency import (
    choose_source,
    get_latency_model,
    kv_capacity_tokens,
    load_profile,
    prefill_saturation_tokens,
    weights_fit,
)
from distserve.latency.validation import compare_to_profile


def make_profile_doc(about: str = "Latency of OPT on NVIDIA A100-80GB") -> dict:
    fit = {
        "prefill_abc": [10.0, 0.1, 1e-5],
        "decode_small_batch_abc": [20.0, 0.001, 0.05],
        "decode_large_batch_abc": [10.0, 0.001, 0.2],
        "large_batch_from": 95,
    }
    return {
        "about": about,
        "engines": {"disaggregated": {"models": {"facebook/opt-13b": {"1": fit}}}},
        "kv_capacity": {
            "rows": [{"model": "facebook/opt-13b", "tp": 1, "pp": 1, "kv_capacity_tokens": 1234}]
        },
    }


def write_profile(tmp_path, doc) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_profile_follows_its_formulas(tmp_path):
    path = write_profile(tmp_path, make_profile_doc())
    lm = get_latency_model(
        "opt-13b", "A100", 1, 2, profile_path=path, enable_dispatch_overhead=False
    )
    assert lm.source == "profile"
    # prefill_ms = (a + b*S1 + c*S2) / pp + pp
    s1, s2 = 100 + 300, 100**2 + 300**2
    assert lm.prefill_stage_s([100, 300]) == pytest.approx(
        ((10 + 0.1 * s1 + 1e-5 * s2) / 2 + 2) / 1e3
    )
    # decode_ms = (a + b*T + c*B) / pp, small-batch coefficients below 95 sequences
    assert lm.decode_stage_s([10, 20]) == pytest.approx((20 + 0.001 * 30 + 0.05 * 2) / 2 / 1e3)
    assert lm.decode_stage_s([10] * 100) == pytest.approx((10 + 0.001 * 1000 + 0.2 * 100) / 2 / 1e3)


def test_dispatch_overhead_is_added_per_iteration():
    with_overhead = get_latency_model("opt-13b", "A100", 1, 1)
    without = get_latency_model("opt-13b", "A100", 1, 1, enable_dispatch_overhead=False)
    # 2 ms + 0.0001 ms per token in the batch
    assert with_overhead.prefill_stage_s([1000]) - without.prefill_stage_s([1000]) == pytest.approx(
        2.1e-3
    )


def test_auto_uses_the_profile_where_it_has_the_point():
    assert get_latency_model("facebook/opt-66b", "a100", 4, 1).source == "profile"
    assert get_latency_model("opt-66b", "a100", 4, 1, serving_mode="colocated").source == "profile"
    assert get_latency_model("opt-175b", "a100", 8, 1).source == "analytic"
    assert get_latency_model("opt-66b", "H100", 4, 1).source == "analytic"  # other GPU


def test_auto_never_mixes_sources_for_a_profiled_model():
    choice = choose_source("opt-66b", "A100")
    assert (choice.source, choice.tps) == ("profile", (2, 3, 4, 8))
    assert choose_source("opt-13b", "A100").tps == (1, 2, 4)
    assert choose_source("opt-66b", "H100").source == "analytic"
    assert choose_source("opt-175b", "A100").tps is None
    with pytest.raises(ValueError, match="from its profile only"):
        get_latency_model("opt-66b", "a100", 1, 4)  # tp 1 is not profiled: no analytic fallback
    assert get_latency_model("opt-66b", "a100", 1, 4, source="analytic").source == "analytic"


def test_profile_source_names_what_is_missing():
    with pytest.raises(ValueError, match=r"tp \[2, 3, 4, 8\]"):
        get_latency_model("opt-66b", "A100", 1, 1, source="profile")
    with pytest.raises(ValueError, match="A100-80GB, not H100-80GB"):
        get_latency_model("opt-66b", "H100", 4, 1, source="profile")


def test_bad_profile_file_names_the_entry(tmp_path):
    doc = make_profile_doc()
    del doc["engines"]["disaggregated"]["models"]["facebook/opt-13b"]["1"]["prefill_abc"]
    with pytest.raises(ValueError, match="opt-13b.1"):
        load_profile(write_profile(tmp_path, doc))


def test_analytic_is_within_20_percent_of_the_a100_profile():
    errors = compare_to_profile("disaggregated")
    covered = {(e.model_name, e.tp) for e in errors}
    assert covered == {
        ("facebook/opt-13b", 1),
        ("facebook/opt-13b", 2),
        ("facebook/opt-13b", 4),
        ("facebook/opt-66b", 2),
        ("facebook/opt-66b", 3),
        ("facebook/opt-66b", 4),
        ("facebook/opt-66b", 8),
    }
    for e in errors:
        assert e.num_points >= 10
        assert e.max_error < 0.20, e
        assert e.mean_error < 0.15, e


def test_analytic_is_monotone_and_faster_with_more_gpus():
    lm1 = get_latency_model("opt-175b", "A100", 8, 2)
    lm2 = get_latency_model("opt-175b", "A100", 8, 4)
    assert lm1.prefill_stage_s([512]) < lm1.prefill_stage_s([1024]) < lm1.prefill_stage_s([2048])
    assert lm1.decode_stage_s([512] * 8) < lm1.decode_stage_s([512] * 64)
    assert lm2.prefill_stage_s([1024]) < lm1.prefill_stage_s([1024])  # fewer layers per stage
    h100 = get_latency_model("opt-175b", "H100", 8, 2)
    assert h100.prefill_stage_s([1024]) < lm1.prefill_stage_s([1024])


def test_decode_is_memory_bound_and_prefill_compute_bound():
    lm = get_latency_model("llama-2-13b", "A100", 1, 1)
    # doubling a small decode batch costs little; doubling a long prompt nearly doubles
    assert lm.decode_stage_s([256] * 16) / lm.decode_stage_s([256] * 8) < 1.15
    assert lm.prefill_stage_s([2048]) / lm.prefill_stage_s([1024]) > 1.8


def test_mixed_iteration_reduces_to_the_pure_phases():
    for source in ("profile", "analytic"):
        lm = get_latency_model("opt-13b", "A100", 1, 1, serving_mode="colocated", source=source)
        assert lm.mixed_stage_s([], [100, 200]) == pytest.approx(lm.decode_stage_s([100, 200]))
        prefill_only = lm.mixed_stage_s([(512, 0)], [])
        assert prefill_only == pytest.approx(lm.prefill_stage_s([512]), rel=1e-6)
        # decodes piggybacked on a chunk cost far less than a separate decode iteration
        mixed = lm.mixed_stage_s([(512, 0)], [300] * 8)
        assert prefill_only < mixed < prefill_only + lm.decode_stage_s([300] * 8)
        # a later chunk of the same prompt attends to everything before it
        assert lm.mixed_stage_s([(512, 1536)], []) > prefill_only


def test_stage_handoff_only_between_stages():
    assert get_latency_model("opt-66b", "A100", 4, 1).stage_handoff_s(1000) == 0.0
    handoff = get_latency_model("opt-66b", "A100", 4, 2).stage_handoff_s(1000)
    assert 0 < handoff < 1e-3  # 18 MB over NVLink


def test_kv_capacity_uses_profile_rows_and_computes_elsewhere():
    assert kv_capacity_tokens("opt-13b", "A100", 1, 1) == 66144  # the profile's row
    computed = kv_capacity_tokens("opt-13b", "A100", 1, 1, profile=load_profile_without_rows())
    assert computed == pytest.approx(66144, rel=0.1)
    assert kv_capacity_tokens("opt-66b", "H100", 4, 1) > kv_capacity_tokens("opt-66b", "H100", 2, 1)
    assert kv_capacity_tokens("opt-66b", "H200", 2, 1) > kv_capacity_tokens("opt-66b", "H100", 2, 1)
    assert kv_capacity_tokens("llama-3-70b", "H100", 4, 1) > kv_capacity_tokens(
        "llama-2-13b", "H100", 4, 1
    )


def load_profile_without_rows():
    from distserve.latency.profile import LatencyProfile

    return LatencyProfile("A100-80GB", {}, {})


def test_weights_that_do_not_fit_leave_no_kv():
    assert not weights_fit("opt-66b", "A100", 1, 1)
    assert kv_capacity_tokens("opt-175b", "A100", 2, 1) == 0
    assert weights_fit("opt-175b", "A100", 8, 1)
    assert weights_fit("llama-3-8b", "L40S", 1, 1)
    assert not weights_fit("opt-66b", "L40S", 2, 1)  # 61 GiB of weights per 45 GiB GPU
    assert weights_fit("smollm2-135m", "CPU", 1, 1)


def test_prefill_saturation_matches_the_paper_for_opt_13b():
    # The paper (section 4.3): one 512-token prompt saturates an A100 for a 13B model.
    assert prefill_saturation_tokens(get_latency_model("opt-13b", "A100", 1, 1)) == 512
    analytic = prefill_saturation_tokens(
        get_latency_model("opt-13b", "A100", 1, 1, source="analytic")
    )
    assert 256 <= analytic <= 768
    # a tiny model on big GPUs needs a much longer batch to saturate them
    tiny = prefill_saturation_tokens(get_latency_model("smollm2-135m", "H100", 1, 1))
    assert tiny > 2048
