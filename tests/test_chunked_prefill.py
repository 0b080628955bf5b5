"""Chapter 10's chunked prefill: how a long prompt is split over steps (scheduled ahead of its tokens, aborted half-way,
over cached blocks), what the runner feeds for a chunk, and engine outputs that equal whole-prompt prefills."""
import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from nanoserve import LLM, SamplingParams
from nanoserve.block_manager import BlockManager, blocks_needed
from nanoserve.model_runner import LONG_CONTEXT, EngineConfig, prepare_inputs, scheduler_config
from nanoserve.prefix_cache import PrefixCachingBlockManager, PrefixCachingScheduler
from nanoserve.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, Sequence, SequenceStatus
from nanoserve.testing import save_tiny_model, tiny_model_dir


def chunked(budget, max_model_len=256, max_num_seqs=4):
    return SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                           enable_chunked_prefill=True)


def seq(i, n, max_tokens=2):
    return Sequence(i, [hash(i) % 1000 + t for t in range(n)], SamplingParams(max_tokens=max_tokens))


def record(s, out, token=0):
    "update() with one token per sampled sequence; finish those that reach max_tokens."
    s.update(out, [token] * len(out.sampled_seqs))
    for q in out.sampled_seqs:
        if not q.is_finished and q.num_output_tokens == q.params.max_tokens: s.finish(q, "length")


def rows(out):
    return [(q.seq_id, n, out.partial.get(q)) for q, n in zip(out.seqs, out.num_new_tokens)]


# --- the configuration ---------------------------------------------------------------------------------------------

def test_config():
    with pytest.raises(ValueError, match="enable_chunked_prefill=True splits it"):
        SchedulerConfig(max_num_batched_tokens=100, max_model_len=200)
    assert SchedulerConfig(max_num_batched_tokens=100, max_model_len=200, max_num_seqs=8, enable_chunked_prefill=True)
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 is below max_num_seqs=8"): chunked(4, max_num_seqs=8)
    with pytest.raises(ValueError, match="enable_chunked_prefill='yes'"): SchedulerConfig(enable_chunked_prefill="yes")
    with pytest.raises(ValueError, match="enable_chunked_prefill=1"): EngineConfig(enable_chunked_prefill=1)
    # the engine's default budget: whole prompts need max(8192, max_model_len); chunks need no more than 8192
    assert scheduler_config(EngineConfig(), 32768).max_num_batched_tokens == 32768
    assert scheduler_config(EngineConfig(enable_chunked_prefill=True), 32768).max_num_batched_tokens == 8192
    assert scheduler_config(EngineConfig(enable_chunked_prefill=True, max_num_seqs=10_000), 32768).max_num_batched_tokens == 10_000
    assert scheduler_config(EngineConfig(enable_chunked_prefill=True, max_num_batched_tokens=512), 32768).enable_chunked_prefill


def test_long_contexts_chunk_unless_told_otherwise():
    "enable_chunked_prefill=None (the default): chunks for a context over LONG_CONTEXT, whole prompts up to it; True/False decide."
    assert LONG_CONTEXT == 32768
    for context, chunks, budget in ((32768, False, 32768), (32769, True, 8192), (131072, True, 8192)):
        c = scheduler_config(EngineConfig(), context)
        assert (c.enable_chunked_prefill, c.max_num_batched_tokens) == (chunks, budget), context
    c = scheduler_config(EngineConfig(max_model_len=4096), 131072)  # the engine's context decides, not the model's
    assert (c.enable_chunked_prefill, c.max_num_batched_tokens) == (False, 8192)
    c = scheduler_config(EngineConfig(enable_chunked_prefill=False), 131072)
    assert (c.enable_chunked_prefill, c.max_num_batched_tokens) == (False, 131072)
    assert scheduler_config(EngineConfig(enable_chunked_prefill=True), 1024).enable_chunked_prefill
    with pytest.raises(ValueError, match=r"expected True, False or None \(on for contexts over 32768 tokens\)"):
        EngineConfig(enable_chunked_prefill="auto")


# --- the scheduler -------------------------------------------------------------------------------------------------

def test_running_sequences_decode_while_a_long_prompt_goes_in_chunks():
    s = Scheduler(chunked(64), BlockManager(32, 16))
    for i, n in enumerate([20, 150, 30]): s.add(seq(i, n, max_tokens=4))
    steps = []
    while s.has_unfinished():
        out = s.schedule()
        steps.append((out.is_prefill, rows(out)))
        assert out.num_batched_tokens <= 64
        record(s, out)
    assert steps[:4] == [(True, [(0, 20, None), (1, 44, 44)]),               # seq 1 gets what is left of the budget
                         (True, [(0, 1, None), (1, 63, 107)]),               # seq 0 decodes alongside seq 1's chunks
                         (True, [(0, 1, None), (1, 43, None), (2, 20, 20)]),  # the rest of seq 1, the start of seq 2
                         (True, [(0, 1, None), (1, 1, None), (2, 10, None)])]
    assert all(not is_prefill for is_prefill, _ in steps[4:]) and s.blocks.num_free_blocks == 32


def test_a_half_done_prompt_is_preempted_before_an_older_stream_waits():
    "Blocks run short while a long prompt goes in chunks: the prompt (the youngest) goes, the older stream keeps its tokens."
    s = Scheduler(chunked(8, max_model_len=64, max_num_seqs=2), BlockManager(9, 4), watermark=0)
    a = seq("a", 2, max_tokens=12)
    s.add(a)
    record(s, s.schedule())
    s.add(seq("h", 32, max_tokens=2))
    steps = []
    while not a.is_finished:
        out = s.schedule()
        steps.append(out)
        record(s, out)
    assert all(a in out.seqs for out in steps)  # a token for `a` in every step
    assert [q.seq_id for out in steps for q in out.preempted] == ["h"]
    while s.has_unfinished(): record(s, s.schedule())
    assert s.blocks.num_free_blocks == 9


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), BlockManager(32, 16))
    for i, n in enumerate([40, 40]): s.add(seq(i, n))
    assert rows(s.schedule()) == [(0, 40, None)]


def test_a_chunk_takes_no_token_and_counts_nothing_in_flight():
    s = Scheduler(chunked(16), BlockManager(8, 16))
    a = seq("a", 40)
    s.add(a)
    out = s.schedule()
    assert out.partial == {a: 16} and out.sampled_seqs == [] and a.num_in_flight == 0
    with pytest.raises(ValueError, match="1 tokens for 0 sequences"): s.update(out, [5])
    s.update(out, [])
    assert a.num_computed_tokens == 16 and a.output_token_ids == [] and s.blocks.num_tokens("a") == 40  # all its blocks


def test_chunks_are_scheduled_ahead_of_their_record():
    "Asynchronous scheduling: the next chunk is scheduled before the last one is recorded."
    s = Scheduler(chunked(16), BlockManager(8, 16))
    a = seq("a", 40, max_tokens=3)
    s.add(a)
    first, second, third = s.schedule(), s.schedule(), s.schedule()
    assert [rows(o) for o in (first, second, third)] == [[("a", 16, 16)], [("a", 16, 32)], [("a", 8, None)]]
    assert a.num_computed_tokens == 0 and a.num_in_flight == 1  # only the last chunk brings a token
    decode = s.schedule()  # the prompt is all scheduled: a decode step may go on before any of it is recorded
    assert not decode.is_prefill and decode.seqs == [a] and a.num_in_flight == 2
    s.update(first, []); s.update(second, [])
    assert a.num_computed_tokens == 32
    s.update(third, [7]); s.update(decode, [8])
    assert a.output_token_ids == [7, 8] and a.num_computed_tokens == 41


def test_an_aborted_half_done_prompt_lets_the_next_one_in():
    s = Scheduler(chunked(16), BlockManager(8, 16))
    s.add(seq("a", 40)); s.add(seq("b", 10))
    out = s.schedule()
    assert rows(out) == [("a", 16, 16)]
    s.abort("a")
    assert s.prefilling is None and rows(s.schedule()) == [("b", 10, None)]
    s.update(out, [])  # the aborted chunk's record changes nothing
    assert s.blocks.num_free_blocks == 7


def test_chunks_of_a_preempted_sequence_cover_its_outputs():
    "A preempted sequence is prefilled again, prompt and outputs, in chunks when the budget is short."
    s = Scheduler(chunked(8, max_model_len=64, max_num_seqs=2), BlockManager(6, 4), watermark=0)
    s.add(seq(0, 8, max_tokens=12)); s.add(seq(1, 8, max_tokens=12))
    readmitted = None
    while s.has_unfinished():
        out = s.schedule()
        victims = {q.seq_id for q in out.preempted}
        if out.is_prefill and any(q.num_preemptions for q in out.seqs): readmitted = readmitted or rows(out)
        record(s, out)
        assert not victims or s.num_preemptions
    assert s.num_preemptions and readmitted and readmitted[-1][2] is not None  # its context is longer than the budget
    assert s.blocks.num_free_blocks == 6


def test_chunks_name_their_blocks_for_the_prefix_cache():
    s = PrefixCachingScheduler(chunked(20), PrefixCachingBlockManager(16, 8))
    s.add(Sequence("a", list(range(50)), SamplingParams(max_tokens=4)))
    first = s.schedule()  # the first 20 tokens: their two full blocks of 8 are named as the chunk is scheduled, no more
    assert len(s.blocks.cached) == 20 // 8
    record(s, first)
    follow = Sequence("b", list(range(17)) + [9999], SamplingParams(max_tokens=1))
    assert len(s.blocks.match(follow)) == 2
    s.add(follow)
    second = s.schedule()
    assert rows(second) == [("a", 20, 40)]  # the whole budget goes on with a
    assert len(s.blocks.cached) == 40 // 8  # the continued chunk names the blocks it completes, not the prompt's rest
    record(s, second)
    third = s.schedule()
    assert rows(third) == [("a", 10, None), ("b", 2, None)] and follow.num_cached_tokens == 16  # b on top of a's blocks


class ChunkedSchedulerMachine(RuleBasedStateMachine):
    "Random arrivals, steps scheduled up to two ahead of their record, and aborts, with chunked prefill."

    @initialize(block_size=st.sampled_from([1, 4, 16]), extra_blocks=st.integers(0, 30), max_num_seqs=st.integers(1, 5),
                budget=st.integers(5, 40), caching=st.booleans())
    def setup(self, block_size, extra_blocks, max_num_seqs, budget, caching):
        self.max_len = 64
        blocks = (PrefixCachingBlockManager if caching else BlockManager)(blocks_needed(self.max_len, block_size) + extra_blocks, block_size)
        cfg = chunked(max(budget, max_num_seqs), self.max_len, max_num_seqs)
        self.s = (PrefixCachingScheduler if caching else Scheduler)(cfg, blocks)
        self.in_flight, self.next_id, self.done = [], 0, {}

    @rule(prompt_len=st.integers(1, 56), max_tokens=st.integers(1, 8), shared=st.booleans())
    def add(self, prompt_len, max_tokens, shared):
        ids = list(range(prompt_len)) if shared else [self.next_id * 100 + t for t in range(prompt_len)]  # some share a start
        self.s.add(Sequence(self.next_id, ids, SamplingParams(max_tokens=max_tokens)))
        self.next_id += 1

    @precondition(lambda self: self.s.has_unfinished() and len(self.in_flight) < 2)
    @rule()
    def schedule(self):
        going_on = self.s.prefilling
        decoders = [q for q in self.s.running if not (going_on and q is going_on[0]) and not q.reaches_max_tokens]
        out, cfg = self.s.schedule(), self.s.config
        assert len(out.seqs) <= cfg.max_num_seqs and len(out.partial) <= 1
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens  # decode tokens count too
        assert all(q is out.seqs[-1] and end < q.num_tokens for q, end in out.partial.items())  # a half-done prompt is last
        k = sum(q in decoders for q in out.seqs)
        assert out.seqs[:k] == [q for q in decoders if q in out.seqs] and out.num_new_tokens[:k] == [1] * k  # the oldest first
        if not out.preempted and k < len(decoders): assert self.s.blocks.num_free_blocks == 0  # one waits only for a block
        if going_on and out.preempted: assert going_on[0] in out.preempted  # the youngest goes first
        if out.preempted: assert len(out.seqs) == k  # nothing admitted in a step that preempts
        prefill = out.seqs[k:]
        if going_on and prefill: assert prefill[0] is going_on[0]  # it goes on before anyone is admitted
        for q, n in zip(prefill, out.num_new_tokens[k:]):  # chunks follow each other without gap or overlap
            start = going_on[1] if going_on and q is going_on[0] else q.num_computed_tokens
            assert start + n == out.partial.get(q, q.num_tokens)
        self.in_flight.append(out)

    @precondition(lambda self: self.in_flight)
    @rule()
    def record(self):
        out = self.in_flight.pop(0)
        record(self.s, out)
        for q in out.sampled_seqs:
            if q.status is SequenceStatus.RUNNING: assert q.num_computed_tokens == q.num_tokens - 1
            if q.is_finished and q.finish_reason == "length": self.done[q.seq_id] = q

    @precondition(lambda self: self.s.has_unfinished())
    @rule(data=st.data())
    def abort(self, data):
        self.s.abort(data.draw(st.sampled_from(sorted(self.s.seqs))))

    @invariant()
    def accounting(self):
        if not hasattr(self, "s"): return
        s = self.s
        assert set(s.blocks.block_tables) == {q.seq_id for q in s.running}
        assert s.prefilling is None or (s.prefilling[0] in s.running and s.prefilling[1] < s.prefilling[0].num_tokens)
        assert s.blocks.num_used_blocks <= s.blocks.num_blocks

    def teardown(self):
        if not hasattr(self, "s"): return
        for _ in range(10_000):
            if not (self.s.has_unfinished() or self.in_flight): break
            if self.in_flight and (len(self.in_flight) == 2 or not self.s.has_unfinished()): self.record()
            else: self.schedule()
        assert not self.s.has_unfinished() and self.s.blocks.num_free_blocks == self.s.blocks.num_blocks
        assert all(q.num_output_tokens == q.params.max_tokens for q in self.done.values())


def test_chunked_scheduler_state_machine():
    run_state_machine_as_test(ChunkedSchedulerMachine, settings=settings(max_examples=150, stateful_step_count=40, deadline=None))


# --- the runner's inputs -------------------------------------------------------------------------------------------

def test_a_chunk_feeds_its_own_tokens_and_attends_to_what_came_before():
    blocks = BlockManager(16, 4)
    a = Sequence("a", list(range(100, 110)))
    blocks.allocate("a", 10)
    first = prepare_inputs(SchedulerOutput([a], [6], True, partial={a: 6}), blocks, "cpu")
    assert first.input_ids.tolist() == list(range(100, 106)) and first.positions.tolist() == list(range(6))
    assert first.metadata.context_lens.tolist() == [6] and first.metadata.slot_mapping.tolist() == blocks.slot_mapping("a", 0, 6)
    one = prepare_inputs(SchedulerOutput([a], [1], True, partial={a: 7}), blocks, "cpu",
                         tokens_in_flight=({a: 0}, torch.tensor([55])))  # a one-token chunk is never a token in flight
    assert one.input_ids.tolist() == [106] and one.positions.tolist() == [6] and one.metadata.context_lens.tolist() == [7]
    last = prepare_inputs(SchedulerOutput([a], [3], True), blocks, "cpu")
    assert last.input_ids.tolist() == [107, 108, 109] and last.metadata.context_lens.tolist() == [10]


# --- the engine ----------------------------------------------------------------------------------------------------

def long_prompts():
    g = torch.Generator().manual_seed(5)
    start = torch.randint(0, 512, (40,), generator=g).tolist()
    return [start + torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 70, 30, 100, 9)] + \
           [torch.randint(0, 512, (n,), generator=g).tolist() for n in (120, 3)]


@pytest.mark.parametrize("arch,window", [("llama", None), ("qwen3", None), ("mistral", 24)])  # Mistral: every layer slides
def test_engine_outputs_equal_with_and_without_chunks(arch, window, tmp_path):
    "Chunks, preemption and cached prefixes (the prompts share 40 tokens) change no output, with a sliding window too."
    d = save_tiny_model(arch, tmp_path / arch, sliding_window=window) if window else tiny_model_dir(arch)
    prompts = long_prompts()
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)] * 5 + \
             [SamplingParams(temperature=0.9, seed=s, max_tokens=20, ignore_eos=True) for s in (1, 2)]
    whole = LLM(d, device="cpu", num_kv_blocks=128, enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    for opts in (dict(max_num_batched_tokens=16, max_num_seqs=8), dict(max_num_batched_tokens=7, max_num_seqs=4, enable_prefix_caching=False),
                 dict(max_num_batched_tokens=33, max_num_seqs=8, num_kv_blocks=12, async_scheduling=False),
                 dict(max_num_batched_tokens=33, max_num_seqs=8, num_kv_blocks=12, async_scheduling=True)):
        llm = LLM(d, device="cpu", max_model_len=256, enable_chunked_prefill=True, **{"num_kv_blocks": 128, **opts})
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == [o.token_ids for o in whole], opts
        for o, w in zip(outs[:5], whole):  # the same float32 computation, cut at other places: log probabilities to ~1e-5
            assert max(abs(a.logprob - b.logprob) for a, b in zip(o.logprobs, w.logprobs)) < 1e-4
        s = llm.llm_engine.scheduler
        assert s.blocks.num_used_blocks == 0 and s.prefilling is None
        assert s.num_steps > 30  # the prompts went in chunks


def test_an_engine_on_a_long_context_chunks_by_default(tmp_path):
    "A model of 40,000 positions: its engine chunks prompts unless told not to, and both give the same tokens."
    d = save_tiny_model("llama", tmp_path / "long", max_position_embeddings=40_000)
    prompts, params = [[7 + i % 400 for i in range(300)], [5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = {}
    for chunks in (None, False):
        llm = LLM(d, device="cpu", num_kv_blocks=64, enable_chunked_prefill=chunks)
        s = llm.llm_engine.scheduler.config
        assert (s.enable_chunked_prefill, s.max_num_batched_tokens) == ((True, 8192) if chunks is None else (False, 40_000))
        assert ("steps of up to 8192 tokens, prompts in chunks" if chunks is None else "steps of up to 40000 tokens, prompts whole") \
            in llm.llm_engine.runner.summary()  # the line the engine logs at start-up
        outputs[chunks] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs[None] == outputs[False]


def test_a_prompt_longer_than_the_budget_runs_only_in_chunks():
    d = tiny_model_dir("llama")
    prompt = long_prompts()[3]  # 140 tokens
    with pytest.raises(ValueError, match="enable_chunked_prefill=True splits it"):
        LLM(d, device="cpu", max_model_len=256, max_num_batched_tokens=64)
    llm = LLM(d, device="cpu", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8, enable_chunked_prefill=True,
              num_kv_blocks=32)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    ref = LLM(d, device="cpu", max_model_len=256, num_kv_blocks=32).generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                                                                            use_tqdm=False)[0]
    assert out.token_ids == ref.token_ids and out.metrics.first_token_time is not None


# --- GPU: the Triton kernels and the prefill graphs on chunks ------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gpu_chunked_prefill_equals_whole_prompts(arch):
    "float32: batched chunks (eager), then one prompt at a time, whose chunks of at most 64 tokens run on prefill graphs."
    d, prompts = tiny_model_dir(arch), long_prompts()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    opts = dict(dtype="float32", max_model_len=256, num_kv_blocks=256)
    whole = [o.token_ids for o in LLM(d, enable_prefix_caching=False, **opts).generate(prompts, params, use_tqdm=False)]
    llm = LLM(d, enable_chunked_prefill=True, max_num_batched_tokens=64, max_num_seqs=8, **opts)
    assert llm.llm_engine.runner.graphs and llm.llm_engine.runner.prefill_graphs
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == whole
    llm.reset_prefix_cache()
    for p, want in zip(prompts, whole): assert llm.generate(p, params, use_tqdm=False)[0].token_ids == want


@pytest.mark.gpu
@needs_gpu
def test_gpu_bf16_logprobs_of_chunked_prompts_match_whole_ones():
    d, prompts = tiny_model_dir("llama"), long_prompts()
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    whole = LLM(d, dtype="bfloat16", max_model_len=256, num_kv_blocks=256, enable_prefix_caching=False)
    chunks = LLM(d, dtype="bfloat16", max_model_len=256, num_kv_blocks=256, enable_prefix_caching=False,
                 enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=8)
    for a, b in zip(whole.generate(prompts, params, use_tqdm=False), chunks.generate(prompts, params, use_tqdm=False)):
        assert a.token_ids == b.token_ids and abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < 0.05


@pytest.mark.gpu
@needs_gpu
def test_gpu_a_step_with_a_chunk_does_not_wait_for_the_gpu():
    "Launching a step that holds a half-done prompt and sampled rows must not synchronize (it would undo async scheduling)."
    llm = LLM(tiny_model_dir("llama"), dtype="bfloat16", max_model_len=256, num_kv_blocks=64, enable_chunked_prefill=True,
              max_num_batched_tokens=48, max_num_seqs=8, enforce_eager=True)
    engine, prompts = llm.llm_engine, long_prompts()
    for p in prompts[:3]: engine.add_request(None, p, SamplingParams(max_tokens=8, ignore_eos=True))
    launches, launch = [], engine.runner.launch
    def checked(out, *args):
        torch.cuda.set_sync_debug_mode("error")  # any host-device synchronization raises
        try: return launch(out, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            launches.append(bool(out.partial) and len(out.sampled_seqs) > 0)
    engine.runner.launch = checked
    while engine.has_unfinished(): engine.step()
    assert any(launches)  # some step held both a chunk and rows that sample
