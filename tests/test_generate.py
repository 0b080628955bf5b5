import pytest, torch
from nanoserve.generate import KVCache, forward_cached, generate
from nanoserve.loader import load_model, resolve_model
from nanoserve.sampling import SamplingParams, greedy_naive
from nanoserve.testing import hf_model, tiny_model_dir
from nanoserve.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def smol():
    return load_model(), load_tokenizer()


class NoText:  # the tiny models have no tokenizer
    stop_token_ids = frozenset()
    def decode(self, ids, skip_special_tokens=False): return ""


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cached_forward_equals_full_forward(arch):
    model = load_model(tiny_model_dir(arch))
    ids = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(5))
    cache = KVCache(model.config, 30)
    with torch.no_grad():
        rows = [forward_cached(model, ids[:10], cache)] + [forward_cached(model, ids[i:i + 1], cache) for i in range(10, 30)]
        torch.testing.assert_close(torch.cat(rows), model(ids), atol=1e-5, rtol=0)


def test_cache_overflow_is_a_clear_error():
    model = load_model(tiny_model_dir("llama"))
    cache = KVCache(model.config, 4)
    with torch.no_grad(), pytest.raises(ValueError, match="KV cache full: 5 positions > max_len=4"):
        forward_cached(model, torch.arange(5), cache)


@pytest.mark.parametrize("text", ["What is the capital of France?", "Name a colour.", "Count to five."])
def test_greedy_equals_naive_and_transformers_on_default_model(smol, text):
    model, tok = smol
    ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
    ours = generate(model, tok, ids, SamplingParams(temperature=0, max_tokens=20)).token_ids
    ref = hf_model(resolve_model()).generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
    assert ours == greedy_naive(model, ids, 20, tok.stop_token_ids) == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equals_transformers_on_tiny_models(arch):
    ids = torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = generate(load_model(tiny_model_dir(arch)), NoText(), ids, SamplingParams(temperature=0, max_tokens=25)).token_ids
    ref = hf_model(tiny_model_dir(arch)).generate(torch.tensor([ids]), max_new_tokens=25, min_new_tokens=25,
                                                  do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours == ref[0, len(ids):].tolist()


def test_paris_finish_reason_and_stats(smol):
    model, tok = smol
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=True)
    pieces = []
    out = generate(model, tok, ids, SamplingParams(temperature=0, max_tokens=50), on_text=pieces.append)
    assert "Paris" in out.text and out.finish_reason == "stop" and "".join(pieces) == out.text
    assert out.token_ids[-1] in tok.stop_token_ids
    s = out.stats
    assert s.prompt_tokens == len(ids) and s.output_tokens == len(out.token_ids)
    assert 0 < s.ttft <= s.total and s.tpot > 0 and s.tokens_per_s > 0


def test_length_finish(smol):
    model, tok = smol
    out = generate(model, tok, tok.encode("Once upon a time"), SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 7
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


def test_stop_string_is_cut_and_never_streamed(smol):
    model, tok = smol
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=True)
    full = generate(model, tok, ids, SamplingParams(temperature=0, max_tokens=30)).text
    stop = full[full.index("Paris") + 2: full.index("Paris") + 4]  # "ri": spans tokens inside a word
    pieces = []
    out = generate(model, tok, ids, SamplingParams(temperature=0, max_tokens=30, stop=[stop]), on_text=pieces.append)
    assert out.finish_reason == "stop" and out.text == full[:full.index(stop)]
    assert "".join(pieces) == out.text and stop not in "".join(pieces)


def test_seeded_sampling_is_reproducible(smol):
    model, tok = smol
    ids = tok.encode("My favourite animal is")
    runs = [generate(model, tok, ids, SamplingParams(temperature=1.0, seed=7, max_tokens=10)).token_ids for _ in range(2)]
    assert runs[0] == runs[1]


def test_prompt_beyond_context_is_refused():
    model = load_model(tiny_model_dir("llama"))  # max_position_embeddings = 512
    with pytest.raises(ValueError, match="exceeds the model's context of 512"):
        generate(model, NoText(), list(range(500)), SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate(model, NoText(), [], SamplingParams(max_tokens=2))
    V = model.config.vocab_size
    for bad, match in [([V], rf"in \[0, {V}\)"), ([-1], "got \\[-1\\]"), ([1.0, 2.0], "integers"), ("hello", "got a str")]:
        with pytest.raises(ValueError, match=match):
            generate(model, NoText(), bad, SamplingParams(max_tokens=2))


@pytest.mark.parametrize("field, value", [("n", 2), ("logprobs", 0), ("prompt_logprobs", 1)])
def test_what_generate_cannot_do_is_refused_not_ignored(field, value):
    model = load_model(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match=f"{field}={value}: generate makes one completion"):
        generate(model, NoText(), [1, 2, 3], SamplingParams(max_tokens=2, **{field: value}))
    with pytest.raises(ValueError, match="params must be a SamplingParams"):
        generate(model, NoText(), [1], None)
    assert generate(model, NoText(), torch.tensor([1, 2]), SamplingParams(max_tokens=2, temperature=0)).token_ids == \
        generate(model, NoText(), [1, 2], SamplingParams(max_tokens=2, temperature=0)).token_ids  # a tensor of ids works
    import numpy as np
    assert generate(model, NoText(), list(np.array([1, 2])), SamplingParams(max_tokens=2, temperature=0)).token_ids == \
        generate(model, NoText(), [1, 2], SamplingParams(max_tokens=2, temperature=0)).token_ids  # and numpy's integers
