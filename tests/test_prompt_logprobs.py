"""Prompt log probabilities (`SamplingParams.prompt_logprobs`, chapters 11a-11b): each prompt token's log probability
given the tokens before it equals transformers' log-softmax, whole or in chunks, through preemption, beside the prefix
cache and one step ahead; the runner's spans; the refusals. A GPU test checks bf16 and the paths that skip graphs."""
import pytest
import torch

from nanoserve import LLM, LLMEngine, SamplingParams, model_runner
from nanoserve.model_runner import prompt_logprob_spans
from nanoserve.scheduler import SchedulerOutput, Sequence
from nanoserve.testing import hf_default_model, hf_model, save_tiny_model, tiny_model_dir

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_prompts(lengths, vocab=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_prompt_logprobs(hf, ids, device="cpu"):
    "transformers' log-softmax over the prompt, float32: (P, V), row i the distribution of token i + 1."
    with torch.no_grad(): return hf(torch.tensor([ids], device=device)).logits[0].float().log_softmax(-1).cpu()


def check_against(expected, out, num_top, atol=1e-5):
    "out.prompt_logprobs against a (P, V) log-softmax: None first, then each prompt token's value and the top tokens."
    ids, got = out.prompt_token_ids, out.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for p, entry in enumerate(got[1:]):
        assert entry.token_id == ids[p + 1]
        assert entry.logprob == pytest.approx(expected[p, ids[p + 1]].item(), abs=atol)
        assert len(entry.top) == num_top
        top = expected[p].topk(num_top)
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=atol)
        if atol <= 1e-5: assert [t for t, _ in entry.top] == top.indices.tolist()


def values(out): return [None if e is None else (e.token_id, e.logprob, [t for t, _ in e.top]) for e in out.prompt_logprobs]


def assert_same(a, b, atol=1e-5):
    "Two runs' prompt log probabilities: the same tokens and top tokens, values within atol."
    for x, y in zip(values(a), values(b), strict=True):
        assert (x is None) == (y is None)
        if x is not None: assert (x[0], x[2]) == (y[0], y[2]) and x[1] == pytest.approx(y[1], abs=atol)


# --- against transformers --------------------------------------------------------------------------------------

def test_default_model_prompt_logprobs_equal_transformers():
    llm = LLM(max_model_len=512, num_kv_blocks=64, device="cpu", dtype="float32")
    prompts = ["The capital of France is Paris, and the capital of Italy is Rome.", "1, 2, 3, 4, 5,", "Hi"]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = hf_default_model()
    for out in outs: check_against(hf_prompt_logprobs(hf, out.prompt_token_ids), out, 3)
    assert outs[2].prompt_logprobs == [None] * len(outs[2].prompt_token_ids)  # "Hi" is one token: nothing before it
    plain = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.token_ids == outs[0].token_ids  # asking changes nothing else


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_models_prompt_logprobs_equal_transformers_beside_requests_without(arch):
    d = tiny_model_dir(arch)
    llm = LLM(d, max_model_len=256, num_kv_blocks=128, device="cpu", dtype="float32")
    prompts = random_prompts((5, 40, 1, 17, 2))
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=k) for k in (0, 2, 1, None, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = hf_model(d)
    for out, p in zip(outs, params):
        if p.prompt_logprobs is None: assert out.prompt_logprobs is None
        else: check_against(hf_prompt_logprobs(hf, out.prompt_token_ids), out, p.prompt_logprobs)


# --- the same values however the prompt is computed ------------------------------------------------------------

CONFIGS = {  # engine options that change how prompts are computed, never what their log probabilities are
    "chunks of 16": dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8),
    "preemption": dict(num_kv_blocks=16, block_size=4),
    "one step ahead": dict(async_scheduling=True),
    "chunks, one step ahead": dict(enable_chunked_prefill=True, max_num_batched_tokens=24, max_num_seqs=8, async_scheduling=True),
    "a half-done prompt preempted": dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=14,
                                         block_size=8, async_scheduling=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prompt_logprobs_do_not_depend_on_chunks_preemption_or_running_ahead(name):
    d = tiny_model_dir("llama")
    prompts = random_prompts((60, 50, 70, 40) if name == "a half-done prompt preempted" else (30, 7, 45, 12), seed=1)
    params = SamplingParams(temperature=0, max_tokens=30 if name == "a half-done prompt preempted" else 12, ignore_eos=True,
                            prompt_logprobs=2)
    base = dict(max_model_len=128, device="cpu", dtype="float32", enable_prefix_caching=False)
    ref = LLM(d, **base, num_kv_blocks=128).generate(prompts, params, use_tqdm=False)
    llm = LLM(d, **{**base, "num_kv_blocks": 128, **CONFIGS[name]})
    outs = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ref, outs):
        assert a.token_ids == b.token_ids
        assert_same(a, b)
    if "preempt" in name: assert sum(o.metrics.num_preemptions for o in outs) > 0  # the case is not vacuous


def test_a_request_with_prompt_logprobs_shares_no_cached_blocks_but_names_its_own():
    d = tiny_model_dir("llama")
    start = random_prompts((40,), seed=2)[0]
    a, b, c = start + [1, 2, 3], start + [4, 5], start + [6, 7, 8, 9]
    llm = LLM(d, max_model_len=128, num_kv_blocks=64, device="cpu", dtype="float32")  # prefix caching is on by default
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    first = llm.generate(a, greedy, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    got = llm.generate(b, scored, use_tqdm=False)[0]  # its prefix is cached, but every position must be computed
    assert got.num_cached_tokens == 0
    check_against(hf_prompt_logprobs(hf_model(d), b), got, 1)
    llm.llm_engine.reset_prefix_cache()
    llm.generate(b, scored, use_tqdm=False)  # computed by a request with prompt log probabilities, and named
    assert llm.generate(c, greedy, use_tqdm=False)[0].num_cached_tokens == 32  # two full blocks of 16 shared


# --- the runner's spans ----------------------------------------------------------------------------------------

def test_spans_cover_the_positions_whose_next_token_is_in_the_prompt():
    wants, plain, short, done = (Sequence(i, list(range(10, 10 + n)), SamplingParams(prompt_logprobs=p))
                                 for i, (n, p) in enumerate([(20, 2), (5, None), (1, 0), (6, 1)]))
    done.output_token_ids.append(3)  # a sequence with an output has all its prompt log probabilities (a recompute)
    out = SchedulerOutput([plain, short, done, wants], [5, 1, 7, 8], True, partial={wants: 8})  # a first chunk of 8
    assert prompt_logprob_spans(out) == [(wants, 0, 8, 13)]
    last = SchedulerOutput([wants], [12], True)  # the rest of its prompt: positions 8..18 (19 predicts the first output)
    assert prompt_logprob_spans(last) == [(wants, 8, 11, 0)]
    assert prompt_logprob_spans(SchedulerOutput([wants], [1], False)) == []  # its decode row: nothing left


def test_long_prompts_go_through_the_lm_head_in_slices(monkeypatch):
    d = tiny_model_dir("qwen3")
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ROWS", 16)  # 100 positions: 7 slices, the last one short
    prompt = random_prompts((101,), seed=3)[0]
    llm = LLM(d, max_model_len=256, num_kv_blocks=64, device="cpu", dtype="float32")
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    check_against(hf_prompt_logprobs(hf_model(d), prompt), out, 1)


def test_prompt_logprobs_fill_by_position_and_make_entries_when_read():
    import pickle
    import numpy as np
    from nanoserve.engine import PromptLogprobs, TokenLogprobs
    p = PromptLogprobs([5, 6, 7, 8], num_top=1)
    assert list(p) == [None] * 4 and len(p) == 4
    p.fill(1, np.array([-1.0, -2.0], np.float32), np.array([[6, 1], [9, 2]]), np.array([[-1.0, -3.0], [-0.5, -4.0]], np.float32))
    p.fill(2, np.array([-9.0, -3.0], np.float32), np.array([[0, 0], [8, 0]]), np.array([[-9.0, -9.0], [-3.0, -5.0]], np.float32))
    assert p[2] == TokenLogprobs(7, -2.0, [(9, -0.5)])  # a recomputed position keeps what it had; the step's top-2 is cut to 1
    assert p[-1] == TokenLogprobs(8, -3.0, [(8, -3.0)]) and p[0] is None and p[1:3] == [p[1], p[2]]
    assert pickle.loads(pickle.dumps(p)) == p == list(p) and p != [None] * 4
    with pytest.raises(IndexError): p[4]


# --- refusals --------------------------------------------------------------------------------------------------

def test_prompt_logprobs_are_checked(tmp_path):
    for bad in (-1, 21, 1.5, True, "2"):
        with pytest.raises(ValueError, match="prompt_logprobs="): SamplingParams(prompt_logprobs=bad)
    save_tiny_model("llama", tmp_path, vocab_size=8)
    engine = LLMEngine(tmp_path, num_kv_blocks=16, device="cpu")
    engine.add_request("good", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=8))
    with pytest.raises(ValueError, match="prompt_logprobs=9: this model has only 8 tokens"):
        engine.add_request("bad", [1, 2], SamplingParams(prompt_logprobs=9))
    while engine.has_unfinished(): outs = engine.step()
    assert [o.request_id for o in outs] == ["good"] and [len(e.top) for e in outs[0].prompt_logprobs[1:]] == [8, 8]


# --- GPU -------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype, atol", [("float32", 1e-4), ("bfloat16", 0.1)])
def test_gpu_prompt_logprobs_equal_transformers(dtype, atol):
    "On the GPU: a lone prompt (which a prefill graph would run) and a batch with a chunk; bf16 within 0.1 of float32 transformers."
    d = tiny_model_dir("llama")
    prompts = random_prompts((100, 9, 300), seed=4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    hf = hf_model(d)
    for options in (dict(), dict(enable_chunked_prefill=True, max_num_batched_tokens=64, max_num_seqs=8)):
        llm = LLM(d, dtype=dtype, max_model_len=512, num_kv_blocks=256, **options)
        assert llm.llm_engine.runner.prefill_graphs  # the lone prompt runs eagerly instead
        alone = llm.generate(prompts[0], params, use_tqdm=False)[0]
        outs = [alone] + llm.generate(prompts[1:], params, use_tqdm=False)
        for out in outs: check_against(hf_prompt_logprobs(hf, out.prompt_token_ids), out, 2, atol)
        del llm
        torch.cuda.empty_cache()
