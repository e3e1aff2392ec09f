"""Presence and frequency penalties: the sampler against a reference computed token by token."""

from __future__ import annotations

import math

import pytest
import torch

from distserve_engine.errors import EngineError
from distserve_engine.sampling import Sampler, SamplingParams, apply_penalties


def reference_penalised(logits: list[float], output_token_ids: list[int], presence: float,
                        frequency: float) -> list[float]:
    """OpenAI's formula, one token at a time: mu[j] - c[j] * alpha_frequency
    - float(c[j] > 0) * alpha_presence, with c[j] counted over the generated tokens."""
    out = []
    for token_id, logit in enumerate(logits):
        count = output_token_ids.count(token_id)
        out.append(logit - count * frequency - (1.0 if count > 0 else 0.0) * presence)
    return out


def make_logits(batch: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("presence, frequency", [(0.0, 0.7), (1.3, 0.0), (-0.5, 1.1), (2.0, -2.0)])
def test_penalised_logits_equal_the_reference(presence, frequency):
    logits = make_logits(3, 12, seed=1)
    outputs = [[3, 3, 3, 5], [], [0, 11, 0, 7, 7, 7, 7]]
    params = [SamplingParams(presence_penalty=presence, frequency_penalty=frequency)] * 3
    got = apply_penalties(logits, params, outputs)
    for row in range(3):
        want = reference_penalised(logits[row].tolist(), outputs[row], presence, frequency)
        torch.testing.assert_close(got[row], torch.tensor(want))


def test_only_rows_with_penalties_change():
    logits = make_logits(2, 8, seed=2)
    params = [SamplingParams(), SamplingParams(frequency_penalty=1.0)]
    got = apply_penalties(logits, params, [[1, 1], [1, 1]])
    torch.testing.assert_close(got[0], logits[0])
    assert got[1, 1] == pytest.approx(logits[1, 1].item() - 2.0)


def test_greedy_choice_follows_the_penalised_logits():
    # Token 0 leads by 1.5; after it was generated twice, a frequency penalty of 1 puts
    # token 1 ahead, and a presence penalty of 2 does it after a single occurrence.
    logits = torch.tensor([[3.0, 1.5, 0.0, -1.0]])
    sampler = Sampler(0)
    greedy = SamplingParams(temperature=0)
    assert sampler(logits, [greedy], [2], [[0, 0]]) == [0]
    freq = SamplingParams(temperature=0, frequency_penalty=1.0)
    assert sampler(logits, [freq], [1], [[0]]) == [0]
    assert sampler(logits, [freq], [2], [[0, 0]]) == [1]
    pres = SamplingParams(temperature=0, presence_penalty=2.0)
    assert sampler(logits, [pres], [1], [[0]]) == [1]


def test_sampled_distribution_follows_the_penalised_softmax():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    params = SamplingParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.25)
    output = [0, 0, 2]
    penalised = reference_penalised(logits[0].tolist(), output, 0.25, 0.5)
    total = sum(math.exp(x) for x in penalised)
    want = torch.tensor([math.exp(x) / total for x in penalised])
    sampler = Sampler(0)
    draws = torch.tensor([sampler(logits, [params], [3], [output])[0] for _ in range(3000)])
    freq = torch.bincount(draws, minlength=3).float() / 3000
    torch.testing.assert_close(freq, want, atol=0.035, rtol=0)


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_out_of_range_penalty_names_the_field(field):
    with pytest.raises(EngineError, match=field):
        SamplingParams(**{field: 2.5})


@pytest.mark.parametrize("presence, frequency", [(0.5, 1.5), (-2.0, -2.0)])
def test_runner_generation_with_penalties_equals_the_reference(tiny_llama_dir, presence, frequency):
    """Greedy generation with penalties on the tiny model equals a reference that scores
    the whole sequence at each step and applies the formula by hand."""
    from test_correctness import make_prompts, tiny_runner

    from distserve_engine.generate import generate

    runner = tiny_runner(tiny_llama_dir, seed=0)
    prompt = make_prompts(384, [8], seed=3)[0]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                            frequency_penalty=frequency, presence_penalty=presence)
    got = generate(runner, [prompt], params)[0].output_token_ids
    want: list[int] = []
    for _ in range(12):
        last = runner.score(prompt + want)[-1].float().tolist()
        penalised = reference_penalised(last, want, presence, frequency)
        want.append(max(range(len(penalised)), key=penalised.__getitem__))
    assert got == want
    if presence < 0:  # negative penalties favour generated tokens: the output repeats itself
        plain = generate(runner, [prompt], SamplingParams(max_tokens=12, temperature=0,
                                                          ignore_eos=True))
        assert plain[0].output_token_ids != got
