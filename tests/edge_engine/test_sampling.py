"""Sampling parameters (validation) and the sampler (reproducible, top-k/top-p)."""

from __future__ import annotations

import pytest
import torch

from edge_engine import InvalidRequestError, SamplingParams
from edge_engine.sampling import sample


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        pytest.param({"temperature": -0.1}, "temperature", id="negative-temperature"),
        pytest.param({"temperature": "hot"}, "temperature", id="temperature-type"),
        pytest.param({"top_p": 0.0}, "top_p", id="top-p-zero"),
        pytest.param({"top_p": 1.5}, "top_p", id="top-p-above-one"),
        pytest.param({"top_p": True}, "top_p", id="top-p-bool"),
        pytest.param({"top_k": -2}, "top_k", id="top-k"),
        pytest.param({"seed": 1.5}, "seed", id="seed-type"),
        pytest.param({"max_tokens": 0}, "max_tokens", id="max-tokens-zero"),
        pytest.param({"stop": [""]}, "stop", id="empty-stop"),
        pytest.param({"stop": 3}, "stop", id="stop-type"),
        pytest.param({"top_logprobs": 21}, "top_logprobs", id="top-logprobs"),
    ],
)
def test_invalid_values_name_their_parameter(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert info.value.to_dict()["error"]["type"] == "invalid_request_error"


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]


def _logits(rows=1, vocab=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def test_greedy_top_k_1_and_tiny_top_p_all_pick_the_argmax():
    logits = _logits(3)
    argmax = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(top_p=1e-6)]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    got = [r.token_id for r in sample(logits, params, gens)]
    assert got == argmax


def test_seeded_draws_are_reproducible_and_respect_top_k():
    logits = _logits(1, vocab=1000)
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    params = SamplingParams(temperature=1.5, top_k=5, seed=7)

    def draws(seed):
        gen = torch.Generator().manual_seed(seed)
        return [sample(logits, [params], [gen])[0].token_id for _ in range(50)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert set(draws(7)) <= allowed and len(set(draws(7))) > 1


def test_top_p_keeps_only_the_nucleus():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0, -2.0]])
    params = SamplingParams(temperature=1.0, top_p=0.9)
    gen = torch.Generator().manual_seed(0)
    # p = softmax: ~0.72, 0.27, ...: the first two reach 0.9
    assert {sample(logits, [params], [gen])[0].token_id for _ in range(200)} == {0, 1}


def test_logprobs_are_log_softmax_of_the_raw_logits():
    logits = _logits(1)
    (r,) = sample(logits, [SamplingParams(temperature=0, logprobs=True, top_logprobs=2)], [None])
    expected = torch.log_softmax(logits[0], -1)
    assert r.logprob == pytest.approx(expected.max().item(), abs=1e-6)
    assert [t for t, _ in r.top_logprobs] == torch.topk(expected, 2).indices.tolist()
