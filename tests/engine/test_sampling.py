"""Sampling parameters, the batched sampler and the stop rules."""

from __future__ import annotations

import pytest
import torch

from distserve_engine.errors import EngineError
from distserve_engine.sampling import Sampler, SamplingParams
from distserve_engine.sequence import Sequence
from distserve_engine.stopping import StopChecker


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"seed": 1.5}, "seed"), ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def make_logits(batch: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_1_take_the_argmax():
    logits = make_logits()
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1, temperature=2.0)] * 2
    assert Sampler(0)(logits, params, [0] * 4) == logits.argmax(-1).tolist()


def test_top_k_and_top_p_keep_only_the_allowed_tokens():
    logits = make_logits(batch=1, vocab=20)
    order = logits[0].argsort(descending=True).tolist()
    sampler = Sampler(0)
    top3 = {sampler(logits, [SamplingParams(top_k=3)], [0])[0] for _ in range(200)}
    assert top3 <= set(order[:3]) and len(top3) > 1
    probs = logits[0].softmax(-1)[order]
    keep = int((probs.cumsum(0) < 0.5).sum()) + 1  # smallest prefix with mass >= 0.5
    nucleus = {sampler(logits, [SamplingParams(top_p=0.5)], [0])[0] for _ in range(200)}
    assert nucleus <= set(order[:keep])


def test_temperature_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    sampler = Sampler(0)
    draws = torch.tensor([sampler(logits, [SamplingParams()], [0])[0] for _ in range(2000)])
    freq = torch.bincount(draws, minlength=3).float() / 2000
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04, rtol=0)


def test_seeded_request_ignores_batch_and_engine_seed():
    logits = make_logits(batch=3)
    seeded = SamplingParams(temperature=1.0, seed=123)
    alone = Sampler(0)(logits[1:2], [seeded], [5])
    in_batch = Sampler(99)(logits, [SamplingParams(), seeded, SamplingParams()], [0, 5, 2])
    assert alone[0] == in_batch[1]
    other_step = [Sampler(0)(logits[1:2], [seeded], [s])[0] for s in range(20)]
    assert len(set(other_step)) > 1  # the step changes the draw


class FakeTokenizer:
    """One character per token id: id i decodes to chr(ord('a') + i); id 0 is EOS."""

    eos_token_ids = frozenset({0})

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids if i != 0)


def run_stop(params: SamplingParams, tokens: list[int], max_model_len: int = 100):
    checker = StopChecker(FakeTokenizer(), max_model_len)
    seq = Sequence(0, [1, 2], params)
    streamed = []
    for t in tokens:
        seq.output_token_ids.append(t)
        streamed.append(checker.update(seq))
        if seq.is_finished:
            break
    return seq, streamed


def test_stop_string_is_cut_and_never_streamed():
    seq, streamed = run_stop(SamplingParams(max_tokens=20, stop=["cde"]), [1, 2, 3, 4, 5, 6])
    assert seq.finish_reason == "stop"
    assert seq.output_text == "b" and "".join(streamed) == "b"
    assert len(seq.output_token_ids) == 4


def test_stop_token_eos_and_ignore_eos():
    seq, streamed = run_stop(SamplingParams(max_tokens=20), [1, 2, 0, 3])
    assert (seq.finish_reason, "".join(streamed)) == ("stop", "bc")
    seq, _ = run_stop(SamplingParams(max_tokens=4, ignore_eos=True), [1, 0, 2, 3, 4])
    assert (seq.finish_reason, seq.output_text) == ("length", "bcd")
    seq, _ = run_stop(SamplingParams(max_tokens=20, stop_token_ids=[3]), [1, 2, 3, 4])
    assert (seq.finish_reason, seq.output_text) == ("stop", "bc")


def test_max_tokens_and_context_limit_give_length():
    seq, streamed = run_stop(SamplingParams(max_tokens=3), [1, 2, 3, 4])
    assert (seq.finish_reason, streamed) == ("length", ["b", "c", "d"])
    seq, _ = run_stop(SamplingParams(max_tokens=50), [1, 2, 3, 4], max_model_len=4)
    assert (seq.finish_reason, len(seq.output_token_ids)) == ("length", 2)


def test_runner_seeded_sampling_is_reproducible(tiny_llama_dir):
    from test_correctness import make_prompts, tiny_runner

    from distserve_engine.generate import generate

    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=11, ignore_eos=True)
    prompts = make_prompts(384, [6, 12], seed=5)
    first = generate(tiny_runner(tiny_llama_dir, seed=1), prompts, params)
    second = generate(tiny_runner(tiny_llama_dir, seed=2), prompts[::-1], params)
    assert first[0].output_token_ids == second[1].output_token_ids
    assert first[1].output_token_ids == second[0].output_token_ids
    with pytest.raises(EngineError, match="max_tokens"):
        SamplingParams(max_tokens=-3)
