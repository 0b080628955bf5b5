"""Chapter 14's speculative decoding: prompt lookup, verification, and the loop, against chapter 7's generate."""
import dataclasses

import pytest
import torch

import nanoserve.speculative as speculative
from nanoserve.generate import generate
from nanoserve.loader import load_model
from nanoserve.sampling import SamplingParams, decisive_logits, sampling_probs
from nanoserve.speculative import ngram_draft, speculative_generate, verify
from nanoserve.testing import save_tiny_model, tiny_model_dir


class NoText:  # the tiny models have no tokenizer
    stop_token_ids = frozenset({2})
    def decode(self, ids, skip_special_tokens=False): return "".join(f"<{i}>" for i in ids)


REPEATING = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 9, 3, 4, 5]  # drafts get proposed


@pytest.fixture(scope="module")
def tiny():
    return load_model(tiny_model_dir("llama"), dtype=torch.float32, device="cpu")


def test_ngram_draft_takes_the_longest_tail_that_occurred_and_its_latest_occurrence():
    assert ngram_draft([5, 6, 7, 8, 9, 1, 2, 6, 7], 3) == [8, 9, 1]
    assert ngram_draft([1, 2, 9, 1, 2, 8, 1, 2], 2) == [8, 1]  # the latest occurrence of (1, 2)
    assert ngram_draft([7, 1, 2, 3, 9, 2, 3, 5, 0, 1, 2, 3], 2) == [9, 2]  # (1, 2, 3) beats the later (2, 3)
    assert ngram_draft([1, 2, 3, 4], 3) == [] and ngram_draft([1], 3) == [] and ngram_draft([1, 1], 0) == []
    assert ngram_draft([4, 4, 4], 5) == [4]  # the tail (4, 4) occurred at 0-1: one token followed it
    assert ngram_draft([256, 1, 1, 256], 2) == [1, 1]  # bytes 00 01 00 00 | 01 00 00 00 ...: no match across tokens
    assert ngram_draft([1, 2, 3, 1, 2, 3], 4, max_n=1) == [1, 2, 3]  # only the last token looked up


@pytest.mark.parametrize("arch,extra", [("llama", {}), ("qwen3", {}), ("qwen2", {}), ("mistral", {"sliding_window": 5})])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_output_is_unchanged_token_for_token(arch, extra, k, tmp_path):
    model = load_model(save_tiny_model(arch, tmp_path / arch, **extra) if extra else tiny_model_dir(arch), dtype=torch.float32, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want, got = generate(model, NoText(), REPEATING, params), speculative_generate(model, NoText(), REPEATING, params, k)
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.drafted > 0 and got.passes == len(got.token_ids) - 1 - got.accepted  # a pass adds its accepted drafts and one token


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=37, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
    SamplingParams(temperature=0, max_tokens=30, logit_bias={5: 3.0, 6: -2.0}, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[6], min_tokens=7),  # a stop token inside an accepted draft
    SamplingParams(temperature=0, max_tokens=30, stop=["<5><6>"], ignore_eos=True),  # a stop string inside an accepted draft
    SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),  # max_tokens cuts the draft
])
def test_greedy_with_penalties_bias_and_stops_is_unchanged(tiny, params):
    want, got = generate(tiny, NoText(), REPEATING, params), speculative_generate(tiny, NoText(), REPEATING, params, 4)
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)


def test_without_drafts_seeded_sampling_draws_what_generate_draws(tiny):
    "k = 0, or nothing to look up: each pass is a plain decode step, with the same random draws as chapter 7's."
    for params in (SamplingParams(temperature=0.9, top_p=0.8, max_tokens=25, seed=3, ignore_eos=True),
                   SamplingParams(temperature=1.3, top_k=20, min_p=0.01, repetition_penalty=1.2, max_tokens=25, seed=4, ignore_eos=True)):
        assert speculative_generate(tiny, NoText(), [1, 2, 3], params, 0).token_ids == generate(tiny, NoText(), [1, 2, 3], params).token_ids


def _pairs(tiny, rule, params, prompt, draft_token, runs, monkeypatch):
    monkeypatch.setattr(speculative, "ngram_draft", lambda tokens, k, max_n=3: [draft_token][:k])
    monkeypatch.setattr(speculative, "verify", rule)
    outs = [tuple(speculative_generate(tiny, NoText(), prompt, dataclasses.replace(params, seed=s)).token_ids[:2]) for s in range(runs)]
    monkeypatch.undo()
    return outs


def test_sampling_keeps_the_models_distribution_and_a_careless_rule_does_not(tiny, monkeypatch):
    "The first two tokens' joint frequencies over 1500 seeds against p(x1) p(x2 | x1), with a draft for x2 in every run."
    prompt, params = [7, 8, 9], SamplingParams(temperature=2.0, top_k=3, max_tokens=3, ignore_eos=True)
    def probs_after(ids):
        with torch.no_grad(): logits = tiny(torch.tensor(ids))[-1:]
        edited, t = decisive_logits(logits, [params])
        return sampling_probs(edited, t, [params])[0]
    first = probs_after(prompt)
    exact = {(a, b): first[a].item() * p for a in first.nonzero()[:, 0].tolist()
             for b, p in enumerate(probs_after(prompt + [a]).tolist()) if p > 0}
    draft_token = max(exact, key=exact.get)[1]
    def accept_any_possible(logits, draft, params, prompt_ids, out, generator=None, stop_token_ids=()):
        edited, t = decisive_logits(logits, [params] * len(logits))
        if draft and sampling_probs(edited, t, [params] * len(logits))[0, draft[0]] > 0: return draft + [0]
        return verify(logits, draft, params, prompt_ids, out, generator, stop_token_ids)
    def chi_square(outs):
        return sum((outs.count(pair) - len(outs) * p) ** 2 / (len(outs) * p) for pair, p in exact.items())
    assert len(exact) == 9
    assert chi_square(_pairs(tiny, verify, params, prompt, draft_token, 1500, monkeypatch)) < 30  # 8 degrees of freedom
    assert chi_square(_pairs(tiny, accept_any_possible, params, prompt, draft_token, 1500, monkeypatch)) > 100


def test_a_refused_draft_is_dropped_from_the_cache(tiny, monkeypatch):
    "Drafts that are always wrong: every pass keeps one token, and the output is still plain greedy decoding's."
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = generate(tiny, NoText(), REPEATING, params).token_ids
    monkeypatch.setattr(speculative, "ngram_draft", lambda tokens, k, max_n=3: [(tokens[-1] * 7 + 1) % 512] * k)
    got = speculative_generate(tiny, NoText(), REPEATING, params, 4)
    assert got.token_ids == want and got.passes == 19 and got.accepted == 0
    assert got.drafted == sum(min(4, 20 - j - 1) for j in range(1, 20))  # the draft never reaches past max_tokens


def test_a_stop_inside_an_accepted_draft_counts_only_the_draft_tokens_output(tiny, monkeypatch):
    want = generate(tiny, NoText(), [1, 2, 3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)).token_ids
    monkeypatch.setattr(speculative, "ngram_draft", lambda tokens, k, max_n=3: want[len(tokens) - 3:len(tokens) - 3 + k])  # always right
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[want[3]])
    got = speculative_generate(tiny, NoText(), [1, 2, 3], params, 8)
    assert got.token_ids == want[:4] and got.finish_reason == "stop"
    assert (got.passes, got.drafted, got.accepted) == (1, 8, 3)  # of the 8 drafted, want[1:4] were output (not 8)


@pytest.mark.parametrize("name,value", [("num_speculative_tokens", -1), ("num_speculative_tokens", 2.0), ("max_ngram", 0),
                                        ("num_speculative_tokens", True)])
def test_bad_arguments_are_value_errors(tiny, name, value):
    kwargs = {"num_speculative_tokens": 2, "max_ngram": 3, name: value}
    with pytest.raises(ValueError, match=f"{name}="):
        speculative_generate(tiny, NoText(), [1, 2], SamplingParams(max_tokens=3), **kwargs)
    with pytest.raises(ValueError, match="logprobs"):  # what generate refuses, this refuses too
        speculative_generate(tiny, NoText(), [1, 2], SamplingParams(max_tokens=3, logprobs=1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_greedy_and_seeded_sampling_on_cuda():
    model = load_model(tiny_model_dir("qwen3"), dtype=torch.float32, device="cuda")
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert speculative_generate(model, NoText(), REPEATING, greedy, 4).token_ids == generate(model, NoText(), REPEATING, greedy).token_ids
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, seed=5, ignore_eos=True)
    assert speculative_generate(model, NoText(), [1, 2, 3], seeded, 0).token_ids == generate(model, NoText(), [1, 2, 3], seeded).token_ids
    out = speculative_generate(model, NoText(), REPEATING, seeded, 4)  # drafts checked on the GPU, draws from its generator
    assert len(out.token_ids) == 30 and out.drafted > 0
