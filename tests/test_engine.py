"""The model runner and the engine (chapters 11a-11b): LLM.generate against transformers, with batching, preemption
and CUDA graphs switched on and off; the engine's errors. GPU tests (marked `gpu`) run the same checks in bf16."""
import gc

import pytest
import torch

from nanoserve import LLM, LLMEngine, SamplingParams
from nanoserve.block_manager import BlockManager
from nanoserve.loader import load_model
from nanoserve.model_runner import (PREFILL_GRAPH_TOKENS, EngineConfig, ModelRunner, _to_device, graph_batch_sizes,
                                    prefill_graph_length, prepare_inputs)
from nanoserve.scheduler import Scheduler, SchedulerOutput, Sequence, SequenceStatus
from nanoserve.testing import hf_default_model, hf_model, save_tiny_model, tiny_model_dir

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class NoText:  # chapter 7's generate wants a tokenizer; the tiny models have none
    stop_token_ids = frozenset()
    def decode(self, ids, skip_special_tokens=False): return ""


def random_prompts(lengths=(3, 17, 40, 9, 64, 1, 33), vocab=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf, prompt, n, device="cpu", **kw):
    ids = torch.tensor([prompt], device=device)  # an explicit mask: else transformers masks every token equal to pad_token_id
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def default_llm():
    return LLM(max_model_len=512, num_kv_blocks=128, device="cpu")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request):
    return request.param, tiny_model_dir(request.param)


# --- against transformers --------------------------------------------------------------------------------------

def test_default_model_batch_equals_transformers(default_llm):
    tok = default_llm.get_tokenizer()
    questions = ["What is the capital of France?", "Name a color.", "Count to five.", "Say hello in Spanish."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False) for q in questions]
    outs = default_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    hf = hf_default_model()
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, tok.encode(p), 16)
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)
    assert "Paris" in outs[0].text


def test_without_a_tokenizer_the_engine_stops_where_transformers_generate_does(tmp_path):
    "Token-id prompts only: the stop ids come from generation_config.json, else config.json, as transformers' generate reads them."
    import json
    path = save_tiny_model("llama", tmp_path / "m")  # config.json's eos_token_id is 2 (LlamaConfig's default)
    prompt, hf = random_prompts()[1], hf_model(path)
    free = hf_greedy(hf, prompt, 20, eos_token_id=None)
    stop = next(t for t in free[2:] if t not in free[:2])  # a token greedy decoding reaches after a few steps
    params = SamplingParams(temperature=0, max_tokens=20)
    def run(): return LLM(path, num_kv_blocks=32, device="cpu").generate([prompt], params, use_tqdm=False)[0]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop]}))
    out = run()
    assert out.token_ids == hf_greedy(hf_model(path), prompt, 20) == free[:free.index(stop) + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop  # no tokenizer, so no end-of-sequence token of its own: vLLM reports them all
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))  # no eos: generate runs to its limit
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": stop}))
    assert run().token_ids == hf_greedy(hf_model(path), prompt, 20) == free
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id='2'"):
        run()


def test_generation_configs_other_end_ids_stop_with_a_stop_reason_as_in_vllm(tmp_path):
    "The tokenizer's own EOS ends a request with no stop_reason; the other ids generation_config.json lists stop it with theirs."
    import json, shutil
    from nanoserve.loader import resolve_model
    path = save_tiny_model("llama", tmp_path / "m", vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"): shutil.copy(resolve_model(None) / name, path / name)
    prompt, greedy = [1, 9690, 198, 15, 16, 17], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    free = LLM(path, num_kv_blocks=32, device="cpu").generate([prompt], greedy, use_tqdm=False)[0].token_ids
    llm = LLM(path, num_kv_blocks=32, device="cpu")
    own = llm.get_tokenizer().eos_token_id
    stop = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i] and own not in free[:i + 1])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [own, stop]}))
    llm = LLM(path, num_kv_blocks=32, device="cpu")
    assert llm.llm_engine.eos_token_ids == {own} and llm.llm_engine.extra_eos_token_ids == (stop,)
    params = SamplingParams(temperature=0, max_tokens=20)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.token_ids == free[:free.index(stop) + 1] and (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert params.stop_token_ids == ()  # the caller's params stay as they were
    assert llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids == free  # ignore_eos ignores them all, as vLLM
    late = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, min_tokens=free.index(stop) + 1), use_tqdm=False)[0]
    assert stop not in late.token_ids[:free.index(stop) + 1]  # min_tokens bans them as it bans EOS


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
def test_tiny_models_batch_equals_transformers(arch):
    d = tiny_model_dir(arch)
    outs = LLM(d, num_kv_blocks=128, device="cpu").generate(random_prompts(), GREEDY, use_tqdm=False)
    hf = hf_model(d)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12, eos_token_id=None) for p in random_prompts()]


@pytest.mark.parametrize("arch,window", [("mistral", {"sliding_window": 8}),  # every layer slides
                                         ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1})])
def test_sliding_windows_batch_equals_transformers(arch, window, tmp_path):
    "Prompts and outputs several windows long: the engine's windowed attention equals transformers', token for token."
    d, params = save_tiny_model(arch, tmp_path / arch, **window), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = LLM(d, num_kv_blocks=128, device="cpu").generate(random_prompts(), params, use_tqdm=False)
    hf = hf_model(d)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12, eos_token_id=None) for p in random_prompts()]
    full = LLM(tiny_model_dir(arch), num_kv_blocks=128, device="cpu").generate(random_prompts(), params, use_tqdm=False)
    moved = max(abs(a.outputs[0].cumulative_logprob - b.outputs[0].cumulative_logprob) for a, b in zip(full, outs))
    assert moved > 1e-3  # the same weights without the window compute something else


def test_one_at_a_time_and_preemption_change_nothing(tiny):
    arch, d = tiny
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in LLM(d, num_kv_blocks=256, device="cpu").generate(random_prompts(), params, use_tqdm=False)]
    single = LLM(d, num_kv_blocks=256, max_num_seqs=1, device="cpu")
    assert [o.token_ids for o in single.generate(random_prompts(), params, use_tqdm=False)] == ref
    small = LLM(d, num_kv_blocks=10, block_size=16, device="cpu")
    outs = small.generate(random_prompts(), params, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    assert small.llm_engine.scheduler.num_preemptions > 0 and any(o.metrics.num_preemptions for o in outs)
    assert small.llm_engine.scheduler.blocks.num_free_blocks == 10



# --- async scheduling (the engine one step ahead of the host) -----------------------------------------------

def test_async_scheduling_changes_nothing(tiny):
    arch, d = tiny
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 3, 25, 1)] + \
             [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=30, ignore_eos=True) for s in (1, 2, 3)]
    for pool in (256, 10):  # 10 blocks of 16: preemptions while tokens are in flight
        sync = LLM(d, num_kv_blocks=pool, device="cpu", async_scheduling=False)
        ahead = LLM(d, num_kv_blocks=pool, device="cpu", async_scheduling=True)
        assert ahead.llm_engine.async_scheduling and not sync.llm_engine.async_scheduling
        a, b = (llm.generate(random_prompts(), params, use_tqdm=False) for llm in (sync, ahead))
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert [len(o.token_ids) for o in b] == [p.max_tokens for p in params]
        assert ahead.llm_engine.scheduler.blocks.num_free_blocks == pool and not ahead.llm_engine.has_unfinished()
    assert ahead.llm_engine.scheduler.num_preemptions > 0


def test_penalties_and_logit_bias_equal_chapter_7_sync_async_and_preempted(tiny):
    "The engine's token history (the host's lists; one step ahead, the newest token from the device) gives chapter 7's tokens."
    from nanoserve.generate import generate
    arch, d = tiny
    prompts = random_prompts()[:4]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=1.5),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=2.0, repetition_penalty=1.5),
              SamplingParams(temperature=0.9, seed=3, max_tokens=30, ignore_eos=True, frequency_penalty=-1.0, logit_bias={5: 3.0}),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias={7: 100})]
    model = load_model(d, device="cpu")  # where the engines below run, also on a machine with a GPU
    ref = [generate(model, NoText(), p, sp).token_ids for p, sp in zip(prompts, params)]
    plain = generate(model, NoText(), prompts[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)).token_ids
    assert len(set(ref[0])) > len(set(plain)) and ref[3] == [7] * 30  # the penalty spreads the tokens; +100 forces one
    for overlap, pool in ((False, 256), (True, 256), (True, 8)):  # 8 blocks of 16: preemptions, and recomputed histories
        llm = LLM(d, num_kv_blocks=pool, device="cpu", async_scheduling=overlap)
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref, (overlap, pool)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    with pytest.raises(ValueError, match="logit_bias names token 512"):
        llm.llm_engine.add_request("x", [1, 2], SamplingParams(logit_bias={512: 1.0}))


def test_token_histories_on_the_device_equal_the_host_lists():
    "Rows are filled once, grow, take each step's tokens, and are reused after their sequence ends."
    from nanoserve.model_runner import TokenHistories
    from nanoserve.sampling import TokenHistory
    pen, plain = SamplingParams(frequency_penalty=1.0), SamplingParams()
    seqs = [Sequence(i, list(range(i, i + 5 + 40 * i)), pen if i != 1 else plain) for i in range(4)]  # prompts up to 125 tokens
    seqs[3].output_token_ids = [7, 8]  # recomputed after a preemption: its outputs are sent with its prompt
    h = TokenHistories("cpu")
    for step in range(3):
        got = h.gather(seqs)
        want = TokenHistory.from_lists([s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs], "cpu")
        for a, b in zip(got, want):  # equal up to padding, for the penalised rows (an unpenalised row's history is unused)
            assert [[t for t in r if t >= 0] for r, s in zip(a.tolist(), seqs) if s.params.penalized] == \
                   [[t for t in r if t >= 0] for r, s in zip(b.tolist(), seqs) if s.params.penalized]
        sampled = torch.tensor([100 + step] * 4)
        h.append(sampled)
        for s in seqs: s.output_token_ids.append(100 + step)
    assert h.ids.shape[1] >= 128 and len(h.rows) == 3
    seqs[0].status = SequenceStatus.FINISHED
    newcomer = Sequence(9, [1, 2, 3], pen)
    h.gather([newcomer])
    assert h.rows[newcomer] == 1 and seqs[0] not in h.rows  # the finished sequence's row, reused


def test_min_tokens_holds_back_the_end_in_the_engine_and_in_chapter_7(default_llm):
    "SmolLM2 answers the France question in 8 tokens; with min_tokens=20 it may not stop before 20, in every loop alike."
    from nanoserve.generate import generate
    from nanoserve.tokenizer import load_tokenizer
    tok = default_llm.get_tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=True)
    params = SamplingParams(temperature=0, max_tokens=40, min_tokens=20)
    free = default_llm.generate([ids], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    assert free.finish_reason == "stop" and len(free.token_ids) < 20
    ahead = LLM(max_model_len=512, num_kv_blocks=128, device="cpu", async_scheduling=True)
    outs = [llm.generate([ids], params, use_tqdm=False)[0] for llm in (default_llm, ahead)]
    ref = generate(load_model(device="cpu", dtype=torch.float32), load_tokenizer(), ids, params)
    assert outs[0].token_ids == outs[1].token_ids == ref.token_ids and len(ref.token_ids) >= 20
    assert not set(ref.token_ids[:19]) & set(tok.stop_token_ids)  # no end of turn among the first 19


def test_async_scheduling_stops_and_logprobs_equal_sync(default_llm):
    ahead = LLM(max_model_len=512, num_kv_blocks=128, device="cpu", async_scheduling=True)
    tok = ahead.get_tokenizer()
    chat = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in ("Count from 1 to 10.", "What is the capital of France?", "Name three colors.")]
    params = [SamplingParams(temperature=0, max_tokens=60, stop=["5"]), SamplingParams(temperature=0, max_tokens=40),
              SamplingParams(temperature=0, max_tokens=7, logprobs=3)]
    default_llm.reset_prefix_cache()  # earlier tests ran these prompts: both engines must compute all of them, for equal bits
    a, b = (llm.generate(chat, params, use_tqdm=False) for llm in (default_llm, ahead))
    for x, y in zip(a, b):
        assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
    assert [o.finish_reason for o in b] == ["stop", "stop", "length"]  # a stop string, the end-of-turn token, max_tokens
    assert [(l.token_id, l.top) for l in a[2].logprobs] == [(l.token_id, l.top) for l in b[2].logprobs]
    assert ahead.llm_engine.scheduler.blocks.num_used_blocks == 0


def test_async_abort_while_its_step_is_in_flight():
    d = tiny_model_dir("llama")
    engine = LLMEngine(d, num_kv_blocks=32, device="cpu", async_scheduling=True)
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", [4, 5], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert engine.step() == []  # the prefill's tokens are still on their way
    outs = engine.step()  # they arrive while the first decode step runs
    assert {o.request_id for o in outs} == {"a", "b"} and engine._running is not None
    final = engine.abort("a")  # its decode step is in flight: that token is thrown away
    assert final.finish_reason == "abort" and len(final.token_ids) == 1
    done = []
    while engine.has_unfinished(): done += [o for o in engine.step() if o.finished]
    ref = LLM(d, num_kv_blocks=32, device="cpu", async_scheduling=False).generate([[4, 5]], SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert [o.request_id for o in done] == ["b"] and done[0].token_ids == ref.token_ids
    assert engine.scheduler.blocks.num_used_blocks == 0


def test_async_a_reused_request_id_does_not_take_the_old_token():
    d = tiny_model_dir("llama")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = LLMEngine(d, num_kv_blocks=32, device="cpu", async_scheduling=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.step(); engine.step()  # "a" has a decode step in flight
    engine.abort("a")
    engine.add_request("a", [4], params)  # the same id, a one-token prompt: its prefill must feed token 4, not the old one
    done = []
    while engine.has_unfinished(): done += [o for o in engine.step() if o.finished]
    ref = LLM(d, num_kv_blocks=32, device="cpu", async_scheduling=False).generate([[4]], params, use_tqdm=False)[0]
    assert [o.token_ids for o in done] == [ref.token_ids] and engine._running is None

# --- the API ---------------------------------------------------------------------------------------------------

def test_prompt_and_params_forms(default_llm):
    tok = default_llm.get_tokenizer()
    ids = tok.encode("The capital of France is")
    p = SamplingParams(temperature=0, max_tokens=5)
    as_text = default_llm.generate("The capital of France is", p, use_tqdm=False)
    as_ids = default_llm.generate(ids, p, use_tqdm=False)
    mixed = default_llm.generate([ids, "The capital of France is"], [p, p], use_tqdm=False)
    assert len(as_text) == len(as_ids) == 1 and as_text[0].token_ids == as_ids[0].token_ids
    assert [o.token_ids for o in mixed] == [as_ids[0].token_ids] * 2
    assert as_text[0].prompt == "The capital of France is" and as_ids[0].prompt is None and as_ids[0].prompt_token_ids == ids


def test_outputs_come_back_in_input_order(default_llm):
    lengths = [30, 2, 17, 5]  # finish in a different order than they were given
    outs = default_llm.generate(["Hello"] * 4, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths],
                                use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == lengths and all(o.finish_reason == "length" for o in outs)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)


def test_stop_strings_and_eos(default_llm):
    tok = default_llm.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "Count from 1 to 10."}], add_generation_prompt=True, tokenize=False)
    full = default_llm.generate(chat, SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0]
    assert "5" in full.text
    cut = default_llm.generate(chat, SamplingParams(temperature=0, max_tokens=60, stop=["5"]), use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index("5")]
    assert cut.stop_reason == cut.outputs[0].stop_reason == "5" and full.stop_reason is None
    paris = default_llm.generate(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                 add_generation_prompt=True, tokenize=False), SamplingParams(temperature=0, max_tokens=40),
                                 use_tqdm=False)[0]
    assert paris.finish_reason == "stop" and paris.token_ids[-1] in tok.stop_token_ids and paris.stop_reason is None  # EOS
    by_id = default_llm.generate(chat, SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[full.token_ids[3]]), use_tqdm=False)[0]
    first = full.token_ids.index(full.token_ids[3])  # where that token first comes
    assert by_id.stop_reason == full.token_ids[3] and by_id.token_ids == full.token_ids[:first + 1]
    assert by_id.text == tok.decode(by_id.token_ids[:-1], skip_special_tokens=True)  # without the stop token's text, as vLLM
    kept = default_llm.generate(chat, SamplingParams(temperature=0, max_tokens=60, stop=["5"], include_stop_str_in_output=True),
                                use_tqdm=False)[0]
    assert kept.text == full.text[:full.text.index("5") + 1] and kept.stop_reason == "5"


def test_skip_special_tokens_as_vllm(default_llm):
    "skip_special_tokens=False keeps the text of special tokens, here the end of turn that ignore_eos lets through."
    tok = default_llm.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    base = dict(temperature=0, max_tokens=24, ignore_eos=True)
    skipped = default_llm.generate(chat, SamplingParams(**base), use_tqdm=False)[0]
    shown = default_llm.generate(chat, SamplingParams(**base, skip_special_tokens=False), use_tqdm=False)[0]
    assert shown.token_ids == skipped.token_ids and set(shown.token_ids) & set(tok.stop_token_ids)
    assert skipped.text == tok.decode(skipped.token_ids, skip_special_tokens=True) and "<|im_end|>" not in skipped.text
    assert shown.text == tok.decode(shown.token_ids) and "<|im_end|>" in shown.text


def test_logprobs(default_llm):
    out = default_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)[0]
    assert len(out.logprobs) == 4
    for lp, token in zip(out.logprobs, out.token_ids):
        assert lp.token_id == token and len(lp.top) == 3 and lp.top[0][0] == token  # greedy: the best token
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0
        assert [x[1] for x in lp.top] == sorted((x[1] for x in lp.top), reverse=True)
    assert default_llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].logprobs is None


def test_generate_collects_less_often_while_it_steps_and_restores_the_thresholds(monkeypatch):
    import gc
    from nanoserve import engine as engine_module
    llm = LLM(tiny_model_dir("llama"), num_kv_blocks=16, device="cpu")
    seen, step = [], llm.llm_engine.step
    monkeypatch.setattr(llm.llm_engine, "step", lambda: (seen.append(gc.get_threshold()[0]), step())[1])
    before = gc.get_threshold()
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert set(seen) == {engine_module.ENGINE_GC_THRESHOLD} and gc.get_threshold() == before
    try:
        for user, during in ((0, 0), (10**6, 10**6), (700, engine_module.ENGINE_GC_THRESHOLD)):  # off stays off, higher stays
            gc.set_threshold(user, *before[1:])
            with engine_module.fewer_collections(): assert gc.get_threshold()[0] == during
            with pytest.raises(KeyError), engine_module.fewer_collections(): raise KeyError("a step failed")
            assert gc.get_threshold() == (user, *before[1:])
    finally: gc.set_threshold(*before)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(default_llm):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=10, ignore_eos=True) for s in (1, 2, 3)]
    prompts = ["Once upon a time", "The weather today", "My favourite food"]
    together = [o.token_ids for o in default_llm.generate(prompts, params, use_tqdm=False)]
    alone = [default_llm.generate(p, s, use_tqdm=False)[0].token_ids for p, s in zip(prompts, params)]
    assert together == alone and len(set(map(tuple, together))) == 3


def test_n_completions_per_prompt_as_vllm_returns_them(default_llm):
    "SamplingParams.n: one RequestOutput per prompt whose `outputs` holds n completions, choice j seeded with seed + j."
    from nanoserve.engine import CompletionOutput
    prompts = ["Once upon a time", "The weather today"]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=0, n=3)
    outs = default_llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == 2 and all(len(o.outputs) == 3 for o in outs)
    for prompt, out in zip(prompts, outs):
        alone = [default_llm.generate(prompt, SamplingParams(temperature=1.0, seed=7 + j, max_tokens=8, ignore_eos=True, logprobs=0),
                                      use_tqdm=False)[0] for j in range(3)]
        assert [c.token_ids for c in out.outputs] == [a.token_ids for a in alone]
        assert [c.text for c in out.outputs] == [a.text for a in alone] and [c.index for c in out.outputs] == [0, 1, 2]
        assert (out.text, out.token_ids) == (alone[0].text, alone[0].token_ids)  # the top level is the first choice
        assert out.outputs[1].cumulative_logprob == pytest.approx(sum(t.logprob for t in alone[1].logprobs))
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) == 3
    greedy = default_llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=5, n=2), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids == greedy.token_ids
    one = default_llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert one.outputs == [CompletionOutput(0, one.text, one.token_ids, one.finish_reason)] and one.outputs[0].cumulative_logprob is None
    with pytest.raises(ValueError, match="n=0: expected an integer >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match=r"prompt 1: prompt \(601 tokens\)"):  # the prompt, not the choice
        default_llm.generate(["Hi", "x " * 600], SamplingParams(max_tokens=4, n=3), use_tqdm=False)
    assert not default_llm.llm_engine.requests
    with pytest.raises(ValueError, match="n=2: a request is one sequence here"):
        default_llm.llm_engine.add_request(None, "Hi", SamplingParams(n=2))


def test_n_choices_per_prompt_of_a_params_list_and_a_progress_bar_of_completions(default_llm, capsys):
    "Each prompt gets its own n; the progress bar counts completions (prompts times n), as vLLM V1's does."
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=4, n=3), SamplingParams(temperature=0, max_tokens=4),
              SamplingParams(temperature=1.0, seed=5, max_tokens=4, n=2)]
    outs = default_llm.generate(["Once upon a time", "Hi", "The weather today"], params, use_tqdm=True)
    assert [len(o.outputs) for o in outs] == [3, 1, 2]
    assert [o.prompt for o in outs] == ["Once upon a time", "Hi", "The weather today"]
    bar = capsys.readouterr().err
    assert "Processed prompts" in bar and "6/6" in bar


def test_chat_renders_each_conversation_with_the_template_as_vllm(default_llm):
    tok = default_llm.get_tokenizer()
    conversations = [[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}]]
    greedy = SamplingParams(temperature=0, max_tokens=10)
    texts = [tok.apply_chat_template(c) for c in conversations]
    want = default_llm.generate([tok.encode(t, add_special_tokens=False) for t in texts], greedy, use_tqdm=False)
    got = default_llm.chat(conversations, greedy, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want] and [o.prompt for o in got] == texts
    one = default_llm.chat(conversations[0], greedy, use_tqdm=False)  # one conversation, not a list of them
    assert len(one) == 1 and one[0].token_ids == want[0].token_ids and "Paris" in one[0].text
    for bad, message in [("hi", "messages='hi': expected a conversation"), ([], "messages=\\[\\]"),
                         ([conversations[0], [{"role": "user"}]], "conversation 1: messages\\[0\\]=")]:
        with pytest.raises(ValueError, match=message):
            default_llm.chat(bad, greedy, use_tqdm=False)
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]}]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]  # vLLM joins text parts with newlines
    assert default_llm.chat(parts, greedy, use_tqdm=False)[0].prompt == default_llm.chat(joined, greedy, use_tqdm=False)[0].prompt
    with pytest.raises(ValueError, match="conversation 0: content parts of type 'image_url'"):
        default_llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}], greedy, use_tqdm=False)
    bare = default_llm.chat(conversations[0], greedy, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False})[0]
    assert bare.prompt == tok.apply_chat_template(conversations[0], add_generation_prompt=False)  # merged over the argument
    for kwargs, message in [({"messages": []}, "may not set messages"), ({"template": "x", "tokenize": True}, "may not set template, tokenize"),
                            ([("a", 1)], "expected a dict of template variables")]:  # once TypeErrors, or a confusing ValueError
        with pytest.raises(ValueError, match=message): default_llm.chat(conversations[0], greedy, use_tqdm=False, chat_template_kwargs=kwargs)
    plain = default_llm.chat(conversations[0], greedy, use_tqdm=False, chat_template="{{ messages[0].content }}")[0]
    assert plain.prompt == "What is the capital of France?" == default_llm.generate(plain.prompt, greedy, use_tqdm=False)[0].prompt
    with pytest.raises(ValueError, match="has no tokenizer, so no chat template"):
        LLM(tiny_model_dir("llama"), device="cpu", num_kv_blocks=16).chat(conversations[0])


def test_max_tokens_is_cut_to_max_model_len_as_vllm_does():
    "prompt + max_tokens past max_model_len ends with 'length' at max_model_len; a prompt that fills it gets one token."
    engine = LLMEngine(tiny_model_dir("llama"), max_model_len=32, num_kv_blocks=8, device="cpu")
    asked = SamplingParams(temperature=0, max_tokens=100, min_tokens=50, ignore_eos=True)
    for request_id, prompt_len in [("cut", 20), ("full", 32), ("default", 30)]:  # default: max_tokens=16, 2 left
        engine.add_request(request_id, [1] * prompt_len, SamplingParams(temperature=0, ignore_eos=True) if request_id == "default" else asked)
    with pytest.raises(ValueError, match=r"prompt \(33 tokens\) is longer than max_model_len=32"):
        engine.add_request("long", [1] * 33, asked)
    outs = {}
    while engine.has_unfinished(): outs |= {o.request_id: o for o in engine.step() if o.finished}
    assert {i: (len(o.token_ids), o.finish_reason) for i, o in outs.items()} == {"cut": (12, "length"), "full": (1, "length"),
                                                                                "default": (2, "length")}
    assert (asked.max_tokens, asked.min_tokens) == (100, 50)  # the caller's SamplingParams is theirs: the request cut its copy
    assert engine.scheduler.blocks.num_used_blocks == 0


def test_abort_takes_one_id_or_an_iterable_of_them():
    "vLLM's abort_request: an id or an iterable of ids; anything else is refused, not looked up as str(list)."
    engine = LLMEngine(tiny_model_dir("llama"), num_kv_blocks=32, device="cpu")
    for request_id in "abc": engine.add_request(request_id, [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert [o.request_id for o in engine.abort(["a", "b", "never"])] == ["a", "b"]
    assert [o.request_id for o in engine.abort(iter(["c"]))] == ["c"] and not engine.has_unfinished()
    for bad in [None, 1.5, True, ["a", None], [["a"]]]:
        with pytest.raises(ValueError, match="expected a request id \\(a str or an int\\) or an iterable of them"): engine.abort(bad)
    assert engine.abort([]) == [] and engine.abort("a") is None
    engine.add_request(7, [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))  # kept as "7"
    assert engine.abort(7).request_id == "7" and not engine.has_unfinished()  # as add_request took it


def test_engine_step_abort_and_metrics():
    engine = LLMEngine(tiny_model_dir("llama"), num_kv_blocks=32, device="cpu")
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", [4, 5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = engine.step()
    assert {o.request_id for o in outs} == {"a", "b"} and all(len(o.token_ids) == 1 and not o.finished for o in outs)
    while True:
        done = [o for o in engine.step() if o.finished]
        if done: break
    assert [o.request_id for o in done] == ["b"] and done[0].finish_reason == "length"
    m = done[0].metrics
    assert 0 <= m.ttft <= m.e2e and m.first_scheduled_time <= m.first_token_time and m.tpot(3) >= 0
    held = engine.scheduler.blocks.num_used_blocks
    assert held > 0
    final = engine.abort("a")
    assert final.finished and final.finish_reason == "abort" and len(final.token_ids) == 3
    assert engine.scheduler.blocks.num_used_blocks == 0 and not engine.has_unfinished()
    assert engine.abort("a") is None and engine.step() == []
    assert all(v > 0 for v in engine.step_seconds.values())


def test_non_streaming_requests_report_only_when_finished():
    engine = LLMEngine(tiny_model_dir("llama"), num_kv_blocks=32, device="cpu")
    engine.add_request("quiet", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), stream=False)
    engine.add_request("loud", [4, 5], SamplingParams(max_tokens=5, ignore_eos=True))
    seen = [[o.request_id for o in engine.step()] for _ in range(5)]
    assert seen == [["loud"], ["loud"], ["quiet", "loud"], ["loud"], ["loud"]]


def test_bad_requests_are_refused_and_leave_nothing_behind(default_llm):
    engine = default_llm.llm_engine
    cases = [("", SamplingParams(), "empty"),
             ([1, 2, 10**6], SamplingParams(), r"in \[0, 49152\)"),
             ([1] * 513, SamplingParams(max_tokens=1), r"prompt \(513 tokens\) is longer than max_model_len=512"),
             ("Hi", "greedy", "must be a SamplingParams"), ("Hi", 0, "must be a SamplingParams, got int")]
    for prompt, params, match in cases:
        with pytest.raises(ValueError, match=match): engine.add_request(None, prompt, params)
    with pytest.raises(ValueError, match="prompt 1: .*longer than max_model_len"):
        default_llm.generate(["Hi", [1] * 600], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="3 SamplingParams for 2 prompts"):
        default_llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)
    with pytest.raises(ValueError, match="prompts\\[1\\] is a int"):
        default_llm.generate(["a", 5], use_tqdm=False)
    for prompts, match in [(b"hi", "prompts is bytes"), (5, "prompts is a int"), (None, "prompts is a NoneType")]:
        with pytest.raises(ValueError, match=match): default_llm.generate(prompts, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params is a dict"):
        default_llm.generate([[1]], {"temperature": 0}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"sampling_params\[1\] is a NoneType: expected a SamplingParams"):
        default_llm.generate(["a", "b"], [SamplingParams(), None], use_tqdm=False)
    greedy = SamplingParams(temperature=0, max_tokens=3)
    ids = default_llm.get_tokenizer().encode("Hi")
    as_dicts = default_llm.generate([{"prompt": "Hi"}, {"prompt_token_ids": ids}], greedy, use_tqdm=False)  # vLLM's dict prompts
    assert [o.token_ids for o in as_dicts] == [o.token_ids for o in default_llm.generate(["Hi", ids], greedy, use_tqdm=False)]
    assert as_dicts[0].prompt == "Hi" and default_llm.generate({"prompt": "Hi"}, greedy, use_tqdm=False)[0].token_ids == as_dicts[0].token_ids
    with pytest.raises(ValueError, match=r"prompts\[1\] has the keys \['multi_modal_data', 'prompt'\]"):
        default_llm.generate(["Hi", {"prompt": "Hi", "multi_modal_data": {}}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\] is a int"):
        default_llm.generate({"prompt": 5}, use_tqdm=False)
    with pytest.raises(ValueError, match="got a NoneType"): engine.add_request(None, None)
    with pytest.raises(ValueError, match="stream='no'"): engine.add_request(None, "Hi", stream="no")
    with pytest.raises(ValueError, match="arrival_time='now'"): engine.add_request(None, "Hi", arrival_time="now")
    with pytest.raises(ValueError, match="arrival_time=nan"): engine.add_request(None, "Hi", arrival_time=float("nan"))
    with pytest.raises(ValueError, match=r"stop_token_ids=\[1000000\]: this model's token ids are below 49152"):
        engine.add_request(None, "Hi", SamplingParams(stop_token_ids=[10**6]))
    engine.add_request("dup", "Hi", SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already running"): engine.add_request("dup", "Hi")
    engine.abort("dup")
    with pytest.raises(ValueError, match="prompt 1: text has a lone surrogate"):
        default_llm.generate(["Hi", "\ud800"], use_tqdm=False)
    assert not engine.has_unfinished() and engine.scheduler.blocks.num_used_blocks == 0


def test_generate_leaves_nothing_behind_whatever_a_prompt_raises(default_llm, monkeypatch):
    "Not only ValueError: any error while adding the prompts takes back the ones added before it."
    engine, add = default_llm.llm_engine, default_llm.llm_engine.add_request
    def add_then_fail(request_id, prompt, *args, **kw):
        if prompt == "boom": raise RuntimeError("boom")
        if prompt == "^C": raise KeyboardInterrupt
        return add(request_id, prompt, *args, **kw)
    monkeypatch.setattr(engine, "add_request", add_then_fail)
    for last, error in (("boom", RuntimeError), ("^C", KeyboardInterrupt)):
        with pytest.raises(error): default_llm.generate(["Hi", "there", last], use_tqdm=False)
        assert not engine.has_unfinished() and not engine.requests and engine.scheduler.blocks.num_used_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_interrupted_generate_aborts_its_requests_and_the_engine_goes_on(default_llm, monkeypatch, async_scheduling):
    "A Ctrl-C in the middle of a step leaves its batch half-way through it; generate aborts the batch, so the next call is right."
    if async_scheduling: default_llm = LLM(max_model_len=512, num_kv_blocks=128, device="cpu", async_scheduling=True)  # a step in flight too
    engine = default_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = default_llm.generate(["Hello, my name is", "The sky is"], params, use_tqdm=False)
    launch, calls = engine.runner.launch, []
    def interrupted(*args, **kw):
        calls.append(1)
        if len(calls) == 3: raise KeyboardInterrupt
        return launch(*args, **kw)
    monkeypatch.setattr(engine.runner, "launch", interrupted)
    with pytest.raises(KeyboardInterrupt): default_llm.generate(["Hello, my name is", "The sky is"], params, use_tqdm=False)
    assert not engine.requests and engine.scheduler.blocks.num_used_blocks == 0
    again = default_llm.generate(["Hello, my name is", "The sky is"], params, use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]


def test_requests_keep_their_own_params_and_ids():
    "The caller may reuse a SamplingParams and mix its own request ids with the engine's."
    engine = LLMEngine(tiny_model_dir("llama"), num_kv_blocks=16, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("short", [1, 2], params)
    params.max_tokens = 5
    engine.add_request("long", [1, 2], params)
    engine.add_request("0", [3], SamplingParams(max_tokens=1))  # the id the engine would have picked first
    auto = [engine.add_request(None, [4], SamplingParams(max_tokens=1)) for _ in range(2)]
    assert len(set(auto) | {"0", "short", "long"}) == 5
    done = {}
    while engine.has_unfinished(): done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert len(done["short"].token_ids) == 2 and len(done["long"].token_ids) == 5


def test_generate_refuses_to_run_over_requests_it_did_not_add(default_llm):
    "It steps the engine until its own requests end, and would drop the outputs of any others."
    engine = default_llm.llm_engine
    engine.add_request("mine", "Hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="holds requests that generate did not add \\('mine'\\)"):
        default_llm.generate("Hi", use_tqdm=False)
    while engine.has_unfinished(): outs = engine.step()
    assert [o.request_id for o in outs] == ["mine"]


def test_numpy_token_ids_are_one_prompt():
    import numpy as np
    llm = LLM(tiny_model_dir("llama"), num_kv_blocks=16, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ids = [np.int64(1), np.int64(2), np.int32(3)]
    assert llm.generate(ids, params, use_tqdm=False)[0].token_ids == llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids


def test_logprobs_beyond_the_vocabulary_are_refused_and_the_engine_goes_on(tmp_path):
    "Asked for more alternatives than the model has tokens, the sampler's top-k would fail every step of every batch."
    save_tiny_model("llama", tmp_path, vocab_size=8)
    engine = LLMEngine(tmp_path, num_kv_blocks=16, device="cpu")
    engine.add_request("good", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True, logprobs=8))
    with pytest.raises(ValueError, match="logprobs=9: this model has only 8 tokens"):
        engine.add_request("bad", [1, 2], SamplingParams(logprobs=9))
    while engine.has_unfinished(): outs = engine.step()
    assert [o.request_id for o in outs] == ["good"] and len(outs[0].token_ids) == 3 and len(outs[0].logprobs) == 3


def test_bad_engine_options():
    with pytest.raises(ValueError, match="unknown engine option.*max_num_seq\\b.*valid options: dtype"):
        LLM(tiny_model_dir("llama"), max_num_seq=4)
    for kw, match in [(dict(block_size=12), "power of two"), (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
                      (dict(max_num_seqs=0), "max_num_seqs=0"), (dict(max_num_seqs=65536), "at most 65535 sequences"),
                      (dict(num_kv_blocks=-1), "num_kv_blocks=-1"), (dict(seed=2**70), "seed=1180591620717411303424"),
                      (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization='0.5'"), (dict(enforce_eager="no"), "enforce_eager='no'"),
                      (dict(async_scheduling=1), "async_scheduling=1")]:
        with pytest.raises(ValueError, match=match): EngineConfig(**kw)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        LLM(tiny_model_dir("llama"), max_model_len=10**6, device="cpu")
    with pytest.raises(ValueError, match=r"num_kv_blocks=1000000000000 of 16 tokens: the KV cache needs \d+\.\d+ GiB, and cpu has"):
        LLM(tiny_model_dir("llama"), num_kv_blocks=10**12, device="cpu")  # before it, torch's allocator error (or the OOM killer)


def test_a_kv_cache_that_cannot_be_allocated_is_a_value_error(monkeypatch):
    "Where the OS does not say how much memory is left, the allocator's own failure is turned into the same error."
    import nanoserve.model_runner as mr
    monkeypatch.setattr(mr, "_available_bytes", lambda device: None)
    def fail(message):
        def from_config(*args, **kw): raise RuntimeError(message)
        monkeypatch.setattr(mr.PagedKVCache, "from_config", from_config)
    fail("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8589934592 bytes")
    with pytest.raises(ValueError, match="num_kv_blocks=16 of 16 tokens: .* which could not be allocated: DefaultCPUAllocator"):
        LLM(tiny_model_dir("llama"), num_kv_blocks=16, device="cpu")
    fail("an unrelated bug")  # not relabelled as a memory problem
    with pytest.raises(RuntimeError, match="an unrelated bug"):
        LLM(tiny_model_dir("llama"), num_kv_blocks=16, device="cpu")


def test_model_without_tokenizer_takes_token_ids(tmp_path):
    import shutil
    shutil.copy(tiny_model_dir("llama") / "config.json", tmp_path / "config.json")
    llm = LLM(tmp_path, load_format="dummy", num_kv_blocks=16, device="cpu")
    assert llm.get_tokenizer() is None
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 3 and out.text == ""
    with pytest.raises(ValueError, match="no tokenizer"): llm.generate("text", use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"): llm.generate([[1]], SamplingParams(stop=["x"]), use_tqdm=False)


# --- the runner ------------------------------------------------------------------------------------------------

def test_prepare_inputs_prefill_and_decode():
    blocks = BlockManager(16, 4)
    seqs = [Sequence(i, list(range(10 * i, 10 * i + n))) for i, n in enumerate([5, 1, 6])]
    for s in seqs: blocks.allocate(s.seq_id, s.num_tokens)
    b = prepare_inputs(SchedulerOutput(seqs, [5, 1, 6], True), blocks, "cpu")
    assert b.input_ids.tolist() == [0, 1, 2, 3, 4, 10, 20, 21, 22, 23, 24, 25] and not b.is_decode
    assert b.positions.tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5] and b.sample_rows.tolist() == [4, 5, 11]
    for s, t in zip(seqs, [7, 8, 9]): s.output_token_ids.append(t); blocks.append_slot(s.seq_id)
    b = prepare_inputs(SchedulerOutput(seqs, [1, 1, 1], False), blocks, "cpu")
    assert b.input_ids.tolist() == [7, 8, 9] and b.positions.tolist() == [5, 1, 6] and b.is_decode
    assert b.metadata.slot_mapping.tolist() == [blocks.slot_mapping(s.seq_id)[-1] for s in seqs]
    assert b.metadata.context_lens.tolist() == [6, 2, 7] and b.sample_rows.tolist() == [0, 1, 2]


def test_cpu_kv_pool_is_one_gib():
    runner = ModelRunner(load_model(tiny_model_dir("llama"), device="cpu"), EngineConfig(max_model_len=256))
    assert runner.cache.nbytes <= 2**30 < runner.cache.nbytes + 2 * runner.cache.nbytes / runner.num_blocks
    assert "max concurrency at 256 tokens" in runner.summary() and not runner.graphs


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1] and graph_batch_sizes(5) == [1, 2, 4, 5]
    sizes = graph_batch_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 32] and sizes[-1] == 256 and sizes == sorted(set(sizes))


def test_prefill_graph_length_pads_a_lone_prompt_up_and_leaves_batches_eager():
    assert [prefill_graph_length(1, T, PREFILL_GRAPH_TOKENS) for T in (2, 16, 17, 100, 512)] == [16, 16, 32, 128, 512]
    assert prefill_graph_length(1, 513, PREFILL_GRAPH_TOKENS) is None  # longer than any graph
    assert prefill_graph_length(2, 40, PREFILL_GRAPH_TOKENS) is None  # several prompts in one step
    assert prefill_graph_length(1, 40, {}) is None  # none captured (CPU, enforce_eager)


# --- GPU -------------------------------------------------------------------------------------------------------

def test_an_8_bit_kv_cache_holds_more_tokens_in_the_same_memory():
    "kv_cache_dtype='fp8' (chapter 9c): a float8_e4m3fn pool, four times the blocks of float32 in the CPU's budget."
    for bad in ("int4", True, None):
        with pytest.raises(ValueError, match="kv_cache_dtype"): EngineConfig(kv_cache_dtype=bad)
    d = tiny_model_dir("llama")
    runners = {kv: LLM(d, dtype="float32", device="cpu", max_model_len=256, kv_cache_dtype=kv).llm_engine.runner for kv in ("auto", "fp8")}
    assert runners["auto"].cache.k.dtype == torch.float32 and runners["fp8"].cache.k.dtype == torch.float8_e4m3fn
    assert runners["fp8"].num_blocks == 4 * runners["auto"].num_blocks and "float8_e4m3fn" in runners["fp8"].summary()
    gc.collect()


def test_an_8_bit_kv_cache_serves_the_default_model(default_llm):
    "Rounding keys and values to 8 bits leaves a greedy continuation of the default model's mostly as it was."
    fp8 = LLM(max_model_len=512, num_kv_blocks=128, device="cpu", kv_cache_dtype="fp8")
    params = SamplingParams(temperature=0, max_tokens=16)
    prompts = ["1, 2, 3, 4,", "The capital of France is"]
    assert [o.text for o in fp8.generate(prompts, params, use_tqdm=False)] == [o.text for o in default_llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gpu_an_8_bit_kv_cache_equals_the_cpu_reference(arch):
    "The Triton kernels over a float8_e4m3fn pool, in CUDA graphs and eagerly, give the CPU reference's greedy tokens."
    d, prompts = tiny_model_dir(arch), random_prompts()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    run = lambda **kw: [o.token_ids for o in LLM(d, dtype="float32", max_num_seqs=16, max_model_len=512, num_kv_blocks=1024,
                                                kv_cache_dtype="fp8", **kw).generate(prompts, params, use_tqdm=False)]
    graphs = run()
    assert graphs == run(enforce_eager=True) == run(device="cpu")


@pytest.mark.gpu
@needs_gpu
def test_gpu_to_device_through_pinned_memory_equals_the_array():
    "numpy fills the pinned buffer (not torch's threaded pin_memory copy): the same values arrive, at every size and dtype."
    import numpy as np
    for arr in (np.zeros(0, np.int32), np.arange(7, dtype=np.int32), np.arange(70_000, dtype=np.int32) * 3 - 5,
                np.arange(-40, 40, dtype=np.int64).reshape(4, 20), np.random.default_rng(0).integers(-2**31, 2**31, 300_000, np.int64)):
        t = _to_device(arr, "cuda")
        assert t.device.type == "cuda" and t.shape == arr.shape
        assert torch.equal(t.cpu(), torch.from_numpy(arr).pin_memory().cuda().cpu())  # the path it replaced


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
def test_gpu_cuda_graphs_equal_eager_and_transformers(arch):
    d = tiny_model_dir(arch)
    prompts, params = random_prompts(), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    graphs = LLM(d, dtype="float32", max_num_seqs=16, max_model_len=512, num_kv_blocks=1024)
    eager = LLM(d, dtype="float32", max_num_seqs=16, max_model_len=512, num_kv_blocks=1024, enforce_eager=True)
    assert graphs.llm_engine.runner.graphs and not eager.llm_engine.runner.graphs
    a = [o.token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    assert a == [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert graphs.llm_engine.runner.prefill_graphs  # one prompt at a time: the prefill graphs
    assert [graphs.generate(p, params, use_tqdm=False)[0].token_ids for p in prompts] == a
    hf = hf_model(d).cuda()
    assert a == [hf_greedy(hf, p, 24, device="cuda", eos_token_id=None) for p in prompts]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("arch,window", [("mistral", {"sliding_window": 8}),
                                         ("qwen2", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1})])
def test_gpu_sliding_windows_in_cuda_graphs_equal_eager_and_transformers(arch, window, tmp_path):
    "The Triton kernels' windows, in decode graphs and prefill graphs, on prompts and outputs several windows long."
    d, prompts = save_tiny_model(arch, tmp_path / arch, **window), random_prompts()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    graphs = LLM(d, dtype="float32", max_num_seqs=16, max_model_len=512, num_kv_blocks=1024)
    eager = LLM(d, dtype="float32", max_num_seqs=16, max_model_len=512, num_kv_blocks=1024, enforce_eager=True)
    a = [o.token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    assert a == [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert [graphs.generate(p, params, use_tqdm=False)[0].token_ids for p in prompts] == a  # one at a time: prefill graphs
    hf = hf_model(d).cuda()
    assert a == [hf_greedy(hf, p, 24, device="cuda", eos_token_id=None) for p in prompts]


@pytest.mark.gpu
@needs_gpu
def test_gpu_graph_logits_equal_eager_logits():
    d = tiny_model_dir("llama")
    llm = LLM(d, dtype="bfloat16", max_num_seqs=8, max_model_len=256, num_kv_blocks=256, async_scheduling=False)
    runner, engine = llm.llm_engine.runner, llm.llm_engine
    for i, p in enumerate(random_prompts((5, 9, 13))): engine.add_request(i, p, SamplingParams(temperature=0, max_tokens=50))
    engine.step()  # prefill
    out = engine.scheduler.schedule()  # a decode step of 3, replayed on the graph of 4
    assert runner.graph_size(out) == 4
    replayed = runner.forward(prepare_inputs(out, engine.scheduler.blocks, runner.device, pad_to=4))[:3].clone()
    graphs, runner.graphs = runner.graphs, {}
    eager = runner.forward(prepare_inputs(out, engine.scheduler.blocks, runner.device))
    runner.graphs = graphs
    torch.testing.assert_close(replayed.float(), eager.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("T", [5, 100, 128, 256])
def test_gpu_prefill_graph_logits_equal_eager_logits(T):
    "A lone prompt replays the prefill graph of the next captured length: the logits of the eager pass."
    llm = LLM(tiny_model_dir("llama"), dtype="bfloat16", max_num_seqs=8, num_kv_blocks=256, async_scheduling=False)
    runner, engine = llm.llm_engine.runner, llm.llm_engine
    assert sorted(runner.prefill_graphs) == list(PREFILL_GRAPH_TOKENS)
    engine.add_request(0, random_prompts((T,), seed=T)[0], SamplingParams(temperature=0, max_tokens=4))
    out = engine.scheduler.schedule()
    inputs = prepare_inputs(out, engine.scheduler.blocks, runner.device)
    replayed = runner.forward(inputs).clone()
    graphs, runner.prefill_graphs = runner.prefill_graphs, {}
    eager = runner.forward(inputs)
    runner.prefill_graphs = graphs
    assert replayed.shape == eager.shape == (1, runner.model.config.vocab_size)
    if T in PREFILL_GRAPH_TOKENS:
        assert torch.equal(replayed, eager)  # the same kernels on the same shapes
    else:
        torch.testing.assert_close(replayed.float(), eager.float(), atol=2e-2, rtol=2e-2)  # padded: the matmuls see more rows


@pytest.mark.gpu
@needs_gpu
def test_gpu_bf16_batched_equals_one_at_a_time_and_sizes_kv_from_memory():
    d = tiny_model_dir("qwen3")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    gc.collect(); torch.cuda.empty_cache()  # engines of earlier tests: the profile must see only this one
    batched = LLM(d, dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.5)
    runner = batched.llm_engine.runner
    free, total = torch.cuda.mem_get_info()
    assert runner.num_blocks > 1000 and runner.cache.nbytes < 0.5 * total
    outs = [o.token_ids for o in batched.generate(random_prompts(), params, use_tqdm=False)]
    del batched, runner
    single = LLM(d, dtype="bfloat16", max_model_len=512, max_num_seqs=1, num_kv_blocks=512)
    assert outs == [single.generate(p, params, use_tqdm=False)[0].token_ids for p in random_prompts()]


@pytest.mark.gpu
@needs_gpu
def test_gpu_penalties_one_step_ahead_in_cuda_graphs_equal_sync():
    "On a GPU the newest token of a penalised row comes from the running step on the device; the graphed engine gives sync's tokens."
    d = tiny_model_dir("llama")
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=1.5),
              SamplingParams(temperature=0.9, seed=4, max_tokens=40, ignore_eos=True, presence_penalty=1.0, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logit_bias={9: 100})]
    from nanoserve.generate import generate
    model = load_model(d, dtype=torch.float32, device="cuda")
    ref = [generate(model, NoText(), p, sp).token_ids for p, sp in zip(random_prompts()[:3], params)]  # chapter 7, the host's lists
    for overlap in (False, True):
        llm = LLM(d, dtype="float32", max_num_seqs=8, num_kv_blocks=256, async_scheduling=overlap)
        assert llm.llm_engine.runner.graphs and llm.llm_engine.async_scheduling == overlap
        assert [o.token_ids for o in llm.generate(random_prompts()[:3], params, use_tqdm=False)] == ref, overlap
    assert ref[2] == [9] * 40


def test_streamed_outputs_are_snapshots(default_llm):
    "An output handed out stays as it was while the request goes on (token ids and log probabilities alike)."
    engine = default_llm.llm_engine
    engine.add_request("snap", "The capital of France is", SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True))
    outs = []
    while engine.has_unfinished(): outs += engine.step()
    assert [len(o.token_ids) for o in outs] == [1, 2, 3, 4, 5, 6]
    assert all(len(o.logprobs) == len(o.token_ids) for o in outs)



@pytest.mark.gpu
@needs_gpu
def test_gpu_async_scheduling_equals_sync():
    d = tiny_model_dir("llama")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 3, 25, 1, 40, 12, 30)]
    outs = {}
    for overlap in (False, True):
        llm = LLM(d, dtype="bfloat16", max_num_seqs=16, max_model_len=512, num_kv_blocks=1024, async_scheduling=overlap)
        assert llm.llm_engine.async_scheduling is overlap
        outs[overlap] = [o.token_ids for o in llm.generate(random_prompts(), params, use_tqdm=False)]
    assert outs[True] == outs[False]


def test_llm_starts_from_the_models_generation_config_as_vllm_does(tmp_path):
    "generation_config='auto' (the default): the model's recommendations; 'vllm': none; a folder: its file's."
    import json, shutil
    from nanoserve.engine import model_sampling_defaults
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    generation = json.loads((model / "generation_config.json").read_text())
    recommended = {"temperature": 0.0, "top_p": 0.8, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 5}
    (model / "generation_config.json").write_text(json.dumps(generation | recommended | {"do_sample": True, "num_beams": 1}))
    llm = LLM(model, device="cpu", num_kv_blocks=64, max_model_len=128)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (0.0, 0.8, 7, 0.05, 1.1, 5)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    assert [o.token_ids for o in llm.generate(prompts, use_tqdm=False)] == [o.token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
    assert all(len(o.token_ids) <= 5 for o in llm.generate(prompts, use_tqdm=False))
    (model / "generation_config.json").write_text(json.dumps(generation | {"temperature": 0.0, "max_new_tokens": 1000}))
    long = LLM(model, device="cpu", num_kv_blocks=64, max_model_len=128, enable_prefix_caching=False)
    capped = long.generate([list(range(1, 101))], SamplingParams(temperature=0, max_tokens=125, ignore_eos=True), use_tqdm=False)
    assert len(capped[0].token_ids) == 28 and capped[0].finish_reason == "length"  # a request's own max_tokens is cut too
    defaulted = long.generate([[1, 2, 3], list(range(1, 101))], use_tqdm=False)  # max_new_tokens 1000: what each prompt leaves
    assert all(len(o.token_ids) <= 128 - len(o.prompt_token_ids) for o in defaulted)
    assert model_sampling_defaults(model, "vllm") == {}
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "eos_token_id": 2}))
    assert model_sampling_defaults(model, str(other)) == {"top_p": 0.5}
    assert model_sampling_defaults(None) == {}  # the built-in default model recommends nothing
    with pytest.raises(ValueError, match="expected 'auto', 'vllm' or a folder that holds a generation_config.json"):
        model_sampling_defaults(model, str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="generation_config="):
        EngineConfig(generation_config="")
    (model / "generation_config.json").write_text(json.dumps(generation | {"top_p": 0}))
    with pytest.raises(ValueError, match=r"generation_config.json: top_p=0"):
        LLM(model, device="cpu", num_kv_blocks=64, max_model_len=128)


def test_override_generation_config_sets_fields_over_the_models(tmp_path, caplog):
    "vLLM's --override-generation-config: generation_config.json's names, merged over the model's file, alone with 'vllm'."
    import json, shutil
    from nanoserve.engine import model_sampling_defaults
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(generation | {"temperature": 0.6, "top_p": 0.9, "top_k": 20}))
    override = {"temperature": 0.0, "max_new_tokens": 4, "top_k": None}  # a null clears the file's top_k, as in vLLM's merge
    assert model_sampling_defaults(model, "auto", override) == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 4}
    assert model_sampling_defaults(model, "vllm", override) == {"temperature": 0.0, "max_tokens": 4}
    (model / "generation_config.json").write_text(json.dumps(generation | {"temperature": 0.6, "top_p": 0.9}))
    with caplog.at_level("INFO", logger="nanoserve"):
        llm = LLM(model, device="cpu", num_kv_blocks=64, max_model_len=128, override_generation_config=override)
    assert "starts from the sampling defaults {'temperature': 0.0, 'top_p': 0.9, 'max_tokens': 4}" in caplog.text
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.max_tokens) == (0.0, 0.9, 4)
    greedy = SamplingParams(temperature=0, top_p=0.9, max_tokens=4)
    assert [o.token_ids for o in llm.generate([[1, 2, 3]], use_tqdm=False)] == [o.token_ids for o in llm.generate([[1, 2, 3]], greedy, use_tqdm=False)]
    mendable = tmp_path / "mendable"
    mendable.mkdir()
    (mendable / "generation_config.json").write_text(json.dumps({"top_p": 0, "temperature": 0.7}))  # top_p 0: refused alone
    assert model_sampling_defaults(model, str(mendable), {"top_p": 0.5}) == {"temperature": 0.7, "top_p": 0.5}
    with pytest.raises(ValueError, match="generation_config.json: top_p=0"):
        model_sampling_defaults(model, str(mendable), {"temperature": 0.5})
    config = EngineConfig(override_generation_config=override)
    override["temperature"] = -5.0  # the config checked and kept its own copy
    assert config.override_generation_config["temperature"] == 0.0 and hash(config) == hash(EngineConfig(override_generation_config={}))
    for bad, message in [({"max_tokens": 4}, "override_generation_config={'max_tokens': 4}: expected a JSON object of"),
                         ({"temperature": -1}, "override_generation_config: temperature=-1"),
                         ([("temperature", 0)], "override_generation_config=\\[")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(override_generation_config=bad)
