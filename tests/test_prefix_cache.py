"""Chapter 10b: prefix caching. Block names, the three places a block can be (free, in tables, cached and unused) under
random programs, what admission shares and computes, and engine outputs that equal those without the cache."""
import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoserve import LLM, SamplingParams
from nanoserve.block_manager import BlockManager, OutOfBlocks
from nanoserve.prefix_cache import PrefixCachingBlockManager, PrefixCachingScheduler, block_hashes, hash_block
from nanoserve.scheduler import Scheduler, SchedulerConfig, Sequence
from nanoserve.testing import tiny_model_dir


def computed(bm: PrefixCachingBlockManager, seq: Sequence, shared=None) -> list:
    "Allocate `seq` (sharing what the cache holds, or `shared`), mark all of it computed, name its full blocks."
    table = bm.allocate(seq.seq_id, seq.num_tokens, bm.match(seq) if shared is None else shared)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return table


# --- names ---------------------------------------------------------------------------------------------------------

def test_a_block_is_named_by_its_whole_prefix():
    a, b = Sequence("a", list(range(48))), Sequence("b", [99] + list(range(1, 48)))  # differ in token 0 only
    ha, hb = block_hashes(a, 3, 16), block_hashes(b, 3, 16)
    assert len(ha) == 3 and all(x != y for x, y in zip(ha, hb))  # the first token changes every later name
    assert ha[0] == hash_block(b"", range(16)) and ha[1] == hash_block(ha[0], range(16, 32))
    assert hash_block(b"", [1, 2]) != hash_block(b"", [2, 1]) and len(ha[0]) == 32  # order counts; SHA-256


def test_names_span_prompt_and_output_and_are_kept_on_the_sequence():
    s = Sequence("s", list(range(20)))
    s.output_token_ids += list(range(20, 40))
    joined = Sequence("j", list(range(40)))
    assert block_hashes(s, 2, 16) == block_hashes(joined, 2, 16)  # block 1 takes 12 prompt and 4 output tokens
    assert s.block_hashes is block_hashes(s, 1, 16) and len(s.block_hashes) == 2  # extended, never recomputed


# --- the block manager ---------------------------------------------------------------------------------------------

def test_match_shares_full_blocks_and_always_leaves_the_last_token():
    bm = PrefixCachingBlockManager(16, 4)
    computed(bm, Sequence("a", list(range(12))))  # 3 full blocks, all named
    assert len(bm.cached) == 3
    assert len(bm.match(Sequence("same", list(range(12))))) == 2  # 12 tokens: the last block is computed again
    assert len(bm.match(Sequence("longer", list(range(13))))) == 3
    assert len(bm.match(Sequence("diverges", [0, 1, 2, 3, 4, 9, 9, 9, 9]))) == 1
    assert bm.match(Sequence("other", [7] * 9)) == []


def test_shared_blocks_count_and_release():
    bm = PrefixCachingBlockManager(8, 4)
    a_table = computed(bm, Sequence("a", list(range(10))))
    b = Sequence("b", list(range(8)) + [50, 51])
    shared = bm.match(b)
    assert shared == a_table[:2] and bm.blocks_to_take(b.num_tokens, shared) == 1
    bm.allocate("b", b.num_tokens, shared)
    assert [bm.ref_counts[x] for x in shared] == [2, 2] and bm.hit_tokens == 8 and bm.queried_tokens == 20
    bm.free("a")
    assert bm.num_free_blocks == 8 - 3 and not bm.evictable  # a's named blocks are still held by b
    bm.free("b")
    assert bm.num_free_blocks == 8 and list(bm.evictable) == [shared[1], shared[0]] and bm.usage == 0


def test_eviction_takes_the_least_recently_released_named_block():
    bm = PrefixCachingBlockManager(4, 2)
    computed(bm, Sequence("s", [5, 6, 7, 8, 9, 10, 11]))  # 4 blocks, the first 3 named
    bm.free("s")  # tail first: the head is released last, so evicted last
    assert list(bm.free_block_ids) == [3] and list(bm.evictable) == [2, 1, 0]
    bm.allocate("x", 4)  # the free block, then block 2
    assert 2 not in bm.block_hash and len(bm.cached) == 2
    assert bm.match(Sequence("again", [5, 6, 7, 8, 0])) == [0, 1]


def test_taking_back_an_unused_named_block_costs_a_free_block():
    bm = PrefixCachingBlockManager(3, 4)
    computed(bm, Sequence("a", list(range(9))))  # blocks 0, 1 named; all 3 taken
    bm.free("a")
    b = Sequence("b", list(range(8)) + [1] * 4)  # shares 0 and 1 (unused now), needs one more
    shared = bm.match(b)
    assert shared == [0, 1] and bm.num_free_blocks == 3 and bm.blocks_to_take(12, shared) == 3
    bm.allocate("b", 12, shared)
    assert bm.num_free_blocks == 0 and not bm.evictable and bm.ref_counts == [1, 1, 1]
    with pytest.raises(OutOfBlocks): bm.allocate("c", 1)


def test_a_refused_allocation_changes_nothing():
    bm = PrefixCachingBlockManager(3, 4)
    computed(bm, Sequence("a", list(range(9)))); bm.free("a")
    before = (list(bm.free_block_ids), list(bm.evictable), dict(bm.cached), list(bm.ref_counts))
    with pytest.raises(OutOfBlocks): bm.allocate("big", 16, [0, 1])  # 2 shared + 2 new > 3
    assert (list(bm.free_block_ids), list(bm.evictable), dict(bm.cached), list(bm.ref_counts)) == before


@pytest.mark.parametrize("manager", [BlockManager, PrefixCachingBlockManager])
def test_shared_blocks_are_checked(manager):
    bm = manager(8, 4)
    bm.allocate("a", 8)
    with pytest.raises(ValueError, match="hold tokens already"): bm.allocate("b", 12, [0, 5])  # block 5 is free
    with pytest.raises(ValueError, match="distinct"): bm.allocate("b", 12, [0, 0])
    with pytest.raises(ValueError, match="only full blocks"): bm.allocate("b", 7, [0, 1])
    with pytest.raises(ValueError, match="hold tokens already"): bm.can_allocate(8, [8])
    assert "b" not in bm and bm.allocate("b", 9, [0, 1]) == [0, 1, 2] and bm.ref_counts[:3] == [2, 2, 1]


def test_a_prefix_computed_twice_keeps_the_first_name():
    bm = PrefixCachingBlockManager(8, 4)
    a, b = Sequence("a", list(range(9))), Sequence("b", list(range(9)))
    bm.allocate("a", 9); bm.allocate("b", 9)  # admitted together: neither found the other
    for s in (a, b): s.num_computed_tokens = 9; bm.cache_full_blocks(s)
    assert sorted(bm.cached.values()) == bm.block_table("a")[:2]
    bm.free("b")
    assert not bm.evictable and bm.num_free_blocks == 8 - 3  # b's copies went to the free list


def test_reset_forgets_unused_blocks_and_names():
    bm = PrefixCachingBlockManager(8, 4)
    computed(bm, Sequence("a", list(range(9)))); computed(bm, Sequence("b", [7] * 9)); bm.free("a")
    bm.reset_prefix_cache()
    assert not bm.cached and not bm.block_hash and not bm.evictable and bm.num_free_blocks == 8 - 3
    bm.free("b")
    assert sorted(bm.free_block_ids) == list(range(8))


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random allocations (sharing what the cache finds), computed steps, decode appends, releases and resets over prompts
    from a small alphabet, so that prefixes repeat. The test writes, per block, the prefix its keys and values belong to."""
    def __init__(self):
        super().__init__()
        self.bm, self.seqs, self.contents, self.next_id = PrefixCachingBlockManager(12, 4), {}, {}, 0

    @rule(n=st.integers(1, 20), first=st.integers(0, 2), data=st.data())
    def allocate(self, n, first, data):
        tokens = [first] + data.draw(st.lists(st.integers(0, 1), min_size=n - 1, max_size=n - 1))
        seq = Sequence(self.next_id, tokens)
        shared = self.bm.match(seq)
        for i, block in enumerate(shared):  # the point of it all: a shared block holds exactly this prefix
            assert self.contents[block] == tuple(tokens[:(i + 1) * 4])
        if not self.bm.can_allocate(n, shared):
            with pytest.raises(OutOfBlocks): self.bm.allocate(seq.seq_id, n, shared)
            return
        self.bm.allocate(seq.seq_id, n, shared)
        seq.num_computed_tokens = len(shared) * 4
        self.seqs[seq.seq_id], self.next_id = seq, self.next_id + 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def compute(self, data):
        "A step writes the keys and values of everything the sequence holds, then names its full blocks."
        seq = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        table, tokens = self.bm.block_table(seq.seq_id), seq.token_ids
        for p in range(seq.num_computed_tokens, seq.num_tokens):
            self.contents[table[p // 4]] = tuple(tokens[:p + 1])  # its keys and values belong to this prefix
        seq.num_computed_tokens = seq.num_tokens
        self.bm.cache_full_blocks(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 1))
    def append(self, data, token):
        seq = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        if seq.num_computed_tokens < seq.num_tokens or not self.bm.can_append(seq.seq_id): return
        self.bm.append_slot(seq.seq_id)
        seq.output_token_ids.append(token)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        self.bm.free(self.seqs.pop(data.draw(st.sampled_from(sorted(self.seqs)))).seq_id)

    @rule()
    def reset(self): self.bm.reset_prefix_cache()

    @invariant()
    def every_block_is_in_one_place(self):
        bm = self.bm
        free, unused, held = set(bm.free_block_ids), set(bm.evictable), {b for b in range(bm.num_blocks) if bm.ref_counts[b]}
        assert len(free) == len(bm.free_block_ids) and not (free & unused or free & held or unused & held)
        assert free | unused | held == set(range(bm.num_blocks)) and bm.num_free_blocks == len(free) + len(unused)
        counts = [0] * bm.num_blocks
        for s in self.seqs:
            for b in bm.block_table(s): counts[b] += 1
        assert counts == bm.ref_counts
        assert {b: n for n, b in bm.cached.items()} == bm.block_hash and unused <= set(bm.block_hash)

    def teardown(self):
        for s in list(self.seqs): self.bm.free(s)
        assert self.bm.num_free_blocks == self.bm.num_blocks and not any(self.bm.ref_counts)


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# --- the scheduler -------------------------------------------------------------------------------------------------

def drive(sched, max_tokens=2):
    "Step `sched` to the end with a stand-in model; returns the (is_prefill, num_new_tokens) of each step."
    steps = []
    while sched.has_unfinished():
        out = sched.schedule()
        steps.append((out.is_prefill, list(out.num_new_tokens), [s.num_tokens for s in out.seqs]))
        sched.update(out, [0] * len(out.seqs))
        for seq in out.seqs:
            if seq.num_output_tokens == max_tokens: sched.finish(seq, "length")
    return steps


def test_admission_computes_only_what_the_cache_lacks():
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64)
    sched = PrefixCachingScheduler(cfg, PrefixCachingBlockManager(16, 16))
    seqs = [Sequence(i, list(range(40)) + [100 + i] * 5, SamplingParams(max_tokens=2)) for i in range(3)]
    for s in seqs: sched.add(s)
    prefills = [n for is_prefill, n, _ in drive(sched) if is_prefill]
    assert prefills == [[45], [13], [13]]  # 2 blocks of 16 shared: 45 - 32
    assert [s.num_cached_tokens for s in seqs] == [0, 32, 32] and sched.blocks.num_free_blocks == 16


def test_sequences_admitted_in_one_step_share_the_blocks_it_computes():
    "Blocks are named as their step is scheduled: the step stores every layer's keys and values before any query attends."
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=256, max_model_len=64)
    sched = PrefixCachingScheduler(cfg, PrefixCachingBlockManager(16, 16))
    seqs = [Sequence(i, list(range(40)) + [100 + i] * 5, SamplingParams(max_tokens=2)) for i in range(3)]
    for s in seqs: sched.add(s)
    steps = drive(sched)
    assert steps[0][:2] == (True, [45, 13, 13])  # one step: the first computes all, the others what the first leaves
    assert [s.num_cached_tokens for s in seqs] == [0, 32, 32] and sched.blocks.num_free_blocks == 16


@pytest.mark.parametrize("where", ["launch", "admission"])
def test_a_failed_step_forgets_the_names_it_gave(where):
    "A step whose launch raises never wrote the blocks that were named for it when it was scheduled."
    llm = LLM(tiny_model_dir("llama"), device="cpu", num_kv_blocks=32, async_scheduling=False)
    engine = llm.llm_engine
    engine.add_request("a", list(range(40)), SamplingParams(max_tokens=2))
    engine.add_request("b", list(range(40)) + [7], SamplingParams(max_tokens=2))
    def broken(*args, **kwargs): raise RuntimeError("injected failure")
    if where == "launch": engine.runner.launch = broken
    else:  # the second admission's lookup raises, after the first admission has named its blocks
        calls, match = [], engine.scheduler.blocks.match
        def failing_match(seq):
            calls.append(seq)
            if len(calls) == 2: raise RuntimeError("injected failure")
            return match(seq)
        engine.scheduler.blocks.match = failing_match
    with pytest.raises(RuntimeError, match="injected"): engine.step()
    engine.runner.__dict__.pop("launch", None); engine.scheduler.blocks.__dict__.pop("match", None)
    assert not engine.scheduler.blocks.cached  # no name left on a block that holds nothing
    follow = Sequence("b", list(range(40)))
    assert engine.scheduler.blocks.match(follow) == []


def test_decode_blocks_are_named_when_they_fill():
    sched = PrefixCachingScheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64),
                                   PrefixCachingBlockManager(16, 4))
    sched.add(Sequence("a", [1, 2, 3], SamplingParams(max_tokens=10)))
    drive(sched, max_tokens=10)  # 13 tokens: the stand-in samples 0; 12 computed (the last token is never fed back)
    follow = Sequence("b", [1, 2, 3] + [0] * 9 + [5])
    assert len(sched.blocks.match(follow)) == 3  # blocks filled by decode steps are named too


def test_a_preempted_sequence_finds_its_own_blocks():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=64)
    sched = PrefixCachingScheduler(cfg, PrefixCachingBlockManager(6, 16), watermark=0)
    seqs = [Sequence(i, [i] * 30, SamplingParams(max_tokens=30)) for i in range(3)]
    for s in seqs: sched.add(s)
    steps = drive(sched, max_tokens=30)
    assert sched.num_preemptions > 0
    again = [(n, total) for is_prefill, ns, totals in steps[1:] if is_prefill for n, total in zip(ns, totals)]
    assert again and any(n < total for n, total in again)  # a re-admission computes less than all it holds
    assert [s.num_cached_tokens for s in seqs] == [0, 0, 0]  # what a request reports is its first admission


def test_prefix_caching_scheduler_needs_its_block_manager():
    with pytest.raises(ValueError, match="PrefixCachingBlockManager"):
        PrefixCachingScheduler(SchedulerConfig(), BlockManager(8, 16))


def test_outputs_equal_without_the_scheduler_seam():
    "Chapter 10's scheduler and the prefix-caching one take the same steps when nothing is found in the cache."
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=128, max_model_len=128)
    def run(sched_cls, bm_cls):
        sched = sched_cls(cfg, bm_cls(40, 16))  # no preemption: a preempted sequence would find its own blocks
        for i in range(6): sched.add(Sequence(i, [i] * (20 + 7 * i), SamplingParams(max_tokens=12)))
        return drive(sched, max_tokens=12)
    assert run(Scheduler, BlockManager) == run(PrefixCachingScheduler, PrefixCachingBlockManager)


# --- the engine ----------------------------------------------------------------------------------------------------

def shared_start_prompts():
    g = torch.Generator().manual_seed(3)
    start = torch.randint(0, 512, (37,), generator=g).tolist()
    return [start + torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 9, 30, 16, 50, 3, 22)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_outputs_equal_with_and_without_prefix_caching(arch):
    d, prompts = tiny_model_dir(arch), shared_start_prompts()
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 4 + \
             [SamplingParams(temperature=0.9, seed=s, max_tokens=24, ignore_eos=True) for s in (1, 2, 3)]
    base = [o.token_ids for o in LLM(d, device="cpu", num_kv_blocks=128, enable_prefix_caching=False).generate(
        prompts, params, use_tqdm=False)]
    for opts in (dict(num_kv_blocks=128, max_num_seqs=2), dict(num_kv_blocks=9, async_scheduling=False),
                 dict(num_kv_blocks=9, async_scheduling=True)):
        llm = LLM(d, device="cpu", **opts)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == base, opts
        assert sum(o.num_cached_tokens for o in outs) > 0 and all(o.num_cached_tokens % 16 == 0 for o in outs)
        assert llm.llm_engine.scheduler.blocks.num_used_blocks == 0
        again = llm.generate(prompts[:1], params[0], use_tqdm=False)[0]
        assert again.token_ids == base[0] and again.num_cached_tokens == 32  # 38 tokens: 2 full blocks, the rest computed
        assert llm.reset_prefix_cache() and llm.generate(prompts[:1], params[0], use_tqdm=False)[0].num_cached_tokens == 0


def test_identical_prompts_in_one_batch_compute_the_prompt_once():
    "The n choices of a request are identical prompts added together: the first computes, the rest share its full blocks."
    d, prompt = tiny_model_dir("llama"), shared_start_prompts()[0][:40]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)  # greedy: any wrong key shows
    outs = LLM(d, device="cpu", num_kv_blocks=64).generate([prompt] * 4, params, use_tqdm=False)
    ref = LLM(d, device="cpu", num_kv_blocks=64, enable_prefix_caching=False).generate([prompt] * 4, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32, 32]  # (40 - 1) // 16 whole blocks
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    for o, r in zip(outs, ref):
        assert [l.logprob for l in o.logprobs] == pytest.approx([l.logprob for l in r.logprobs], abs=1e-5)


def test_engine_option_and_reset_without_a_cache():
    d = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="enable_prefix_caching"): LLM(d, device="cpu", enable_prefix_caching="yes")
    llm = LLM(d, device="cpu", num_kv_blocks=16, enable_prefix_caching=False)
    assert type(llm.llm_engine.scheduler) is Scheduler and llm.reset_prefix_cache() is False
    out = llm.generate([shared_start_prompts()[0]] * 2, SamplingParams(max_tokens=2), use_tqdm=False)
    assert [o.num_cached_tokens for o in out] == [0, 0]


# --- GPU: the Triton kernels over cached blocks, and the prefill graphs --------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gpu_prefix_caching_equals_no_cache(arch):
    "float32: batched (eager prefill over shared blocks), then one prompt at a time (a prefill graph over its cached prefix)."
    d, prompts = tiny_model_dir(arch), shared_start_prompts()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    opts = dict(dtype="float32", max_model_len=256, num_kv_blocks=256)
    base = [o.token_ids for o in LLM(d, enable_prefix_caching=False, **opts).generate(prompts, params, use_tqdm=False)]
    llm = LLM(d, max_num_seqs=2, **opts)
    assert llm.llm_engine.runner.graphs and llm.llm_engine.runner.prefill_graphs
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == base and sum(o.num_cached_tokens for o in outs) > 0
    for p, want in zip(prompts, base):
        out = llm.generate(p, params, use_tqdm=False)[0]
        assert out.token_ids == want and out.num_cached_tokens == (len(p) - 1) // 16 * 16


@pytest.mark.gpu
@needs_gpu
def test_gpu_bf16_logprobs_over_cached_blocks_match_a_full_prefill():
    d, prompts = tiny_model_dir("llama"), shared_start_prompts()
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    cold = LLM(d, dtype="bfloat16", max_model_len=256, num_kv_blocks=256, enable_prefix_caching=False)
    warm = LLM(d, dtype="bfloat16", max_model_len=256, num_kv_blocks=256)
    warm.generate(prompts[:1], params, use_tqdm=False)  # the shared start is cached from here on
    for a, b in zip(cold.generate(prompts[1:], params, use_tqdm=False), warm.generate(prompts[1:], params, use_tqdm=False)):
        assert b.num_cached_tokens == 32
        assert a.token_ids == b.token_ids and abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < 0.05
