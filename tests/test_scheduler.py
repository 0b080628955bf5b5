import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from nanoserve.block_manager import BlockManager, blocks_needed
from nanoserve.sampling import SamplingParams
from nanoserve.scheduler import Scheduler, SchedulerConfig, Sequence, SequenceStatus


def seq(i, prompt_len, max_tokens=8, arrival=None):
    return Sequence(i, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), arrival_time=i if arrival is None else arrival)


def scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, **kw):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len)
    return Scheduler(cfg, BlockManager(num_blocks, block_size), **kw)


def step(s, finish_at=None):
    "One step with a model that samples token 0; sequences finish at max_tokens (or finish_at[seq_id])."
    out = s.schedule()
    s.update(out, [0] * len(out.seqs))
    for q in out.seqs:
        if q.num_output_tokens == (finish_at or {}).get(q.seq_id, q.params.max_tokens): s.finish(q, "length")
    return out


class SchedulerMachine(RuleBasedStateMachine):
    "Random arrivals, steps and aborts; the budgets and the pool's accounting are checked after every rule."

    @initialize(block_size=st.sampled_from([1, 2, 4, 16]), extra_blocks=st.integers(0, 40), max_num_seqs=st.integers(1, 6),
                budget=st.integers(0, 64))
    def setup(self, block_size, extra_blocks, max_num_seqs, budget):
        self.max_len = 48
        num_blocks = blocks_needed(self.max_len, block_size) + extra_blocks
        self.s = scheduler(num_blocks, block_size, max_num_seqs, self.max_len + budget, self.max_len)
        self.next_id, self.done, self.steps_since_progress = 0, {}, 0
        self.admitted_at = {}

    @rule(prompt_len=st.integers(1, 40), max_tokens=st.integers(1, 8))
    def add(self, prompt_len, max_tokens):
        self.s.add(seq(self.next_id, prompt_len, max_tokens))
        self.next_id += 1

    @precondition(lambda self: self.s.has_unfinished())
    @rule()
    def step(self):
        running_before = list(self.s.running)
        out = self.s.schedule()
        cfg = self.s.config
        assert 0 < len(out.seqs) <= cfg.max_num_seqs and out.num_batched_tokens <= cfg.max_num_batched_tokens
        if out.is_prefill:
            assert all(q not in running_before for q in out.seqs) and out.num_new_tokens == [q.num_tokens for q in out.seqs]
            self.admitted_at.update({q.seq_id: self.s.num_steps for q in out.seqs})
        else:
            assert out.seqs == self.s.running and out.num_new_tokens == [1] * len(out.seqs)
            assert [q for q in running_before if q not in out.preempted] == out.seqs
            for p in out.preempted:  # only the youngest go, never one admitted before a sequence that stays
                assert all(self.admitted_at[p.seq_id] >= self.admitted_at[q.seq_id] for q in out.seqs)
                assert p.status is SequenceStatus.WAITING and p.num_computed_tokens == 0 and not p.block_table
        self.s.update(out, [0] * len(out.seqs))
        for q in out.seqs:
            assert q.num_computed_tokens == q.num_tokens - 1 == self.s.blocks.num_tokens(q.seq_id)
            if q.num_output_tokens == q.params.max_tokens:
                self.s.finish(q, "length")
                self.done[q.seq_id] = q

    @precondition(lambda self: self.s.has_unfinished())
    @rule(data=st.data())
    def abort(self, data):
        victim = data.draw(st.sampled_from(sorted(self.s.seqs)))
        q = self.s.abort(victim)
        assert q.is_finished and q.finish_reason == "abort" and victim not in self.s.seqs and victim not in self.s.blocks

    @invariant()
    def pool_accounting(self):
        if not hasattr(self, "s"): return
        s = self.s
        held = [b for q in s.running for b in q.block_table]
        assert len(held) == len(set(held)) == s.blocks.num_used_blocks
        assert set(s.blocks.block_tables) == {q.seq_id for q in s.running}
        assert all(q.status is SequenceStatus.WAITING for q in s.waiting)
        assert len(s.waiting) + len(s.running) == len(s.seqs)

    def teardown(self):
        "Run to the end: everything finishes (nothing starves) and the pool is whole again."
        if not hasattr(self, "s"): return
        for _ in range(10_000):
            if not self.s.has_unfinished(): break
            self.step()
        assert not self.s.has_unfinished() and self.s.blocks.num_free_blocks == self.s.blocks.num_blocks
        assert all(q.num_output_tokens == q.params.max_tokens for q in self.done.values())


def test_scheduler_state_machine():
    run_state_machine_as_test(SchedulerMachine, settings=settings(max_examples=150, stateful_step_count=40, deadline=None))


def test_prefill_admits_in_order_under_the_token_budget():
    s = scheduler(max_num_batched_tokens=64, num_blocks=64)
    for i, n in enumerate([30, 30, 10, 2]): s.add(seq(i, n))
    out = step(s)  # 60 tokens; seq 2 would pass the budget, and seq 3 must not jump the queue
    assert out.is_prefill and [q.seq_id for q in out.seqs] == [0, 1]
    out = step(s)
    assert out.is_prefill and [q.seq_id for q in out.seqs] == [2, 3]


def test_sequence_cap():
    s = scheduler(max_num_seqs=2, num_blocks=64)
    for i in range(3): s.add(seq(i, 4))
    assert [q.seq_id for q in step(s).seqs] == [0, 1]
    assert not step(s).is_prefill  # the cap is reached: decode, seq 2 waits
    assert s.num_waiting == 1


def test_preempts_the_youngest_and_recomputes_it():
    s = scheduler(num_blocks=4, block_size=4, watermark=0)
    s.add(seq(0, 4, max_tokens=8)); s.add(seq(1, 4, max_tokens=8))
    step(s)  # both admitted, one full block each
    assert s.blocks.num_free_blocks == 2
    for _ in range(4): step(s)  # positions 4-7: each takes a second block, then fills it
    out = step(s)  # position 8: both need a third block, none is free
    assert [q.seq_id for q in out.preempted] == [1] and [q.seq_id for q in out.seqs] == [0]
    assert s.waiting[0].seq_id == 1 and s.waiting[0].num_preemptions == 1 and s.num_preemptions == 1
    outputs_before = list(s.waiting[0].output_token_ids)
    while s.has_unfinished(): out = step(s)
    assert s.blocks.num_free_blocks == 4


def test_readmission_prefills_prompt_and_outputs():
    s = scheduler(num_blocks=4, block_size=4, watermark=0)
    s.add(seq(0, 4, max_tokens=8)); s.add(seq(1, 4, max_tokens=8))
    for _ in range(6): out = step(s)
    victim = out.preempted[0]
    n = victim.num_tokens
    assert n > victim.num_prompt_tokens
    while True:
        out = step(s)
        if out.is_prefill: break
    assert out.seqs == [victim] and out.num_new_tokens == [n]


def test_finished_sequences_free_blocks_in_the_same_step():
    s = scheduler(num_blocks=8)
    s.add(seq(0, 5, max_tokens=1))
    out = step(s)
    assert out.seqs[0].is_finished and s.blocks.num_free_blocks == 8 and not s.has_unfinished()


@pytest.mark.parametrize("prompt_len, max_tokens, match", [(60, 10, "exceeds max_model_len=64"),
                                                           (64, 2, r"\(64 tokens\) \+ max_tokens \(2\) = 66 exceeds"),
                                                           (65, 1, r"prompt \(65 tokens\) is longer than max_model_len=64"),
                                                           (30, 10, "whole cache has 8")])
def test_refuses_what_can_never_fit(prompt_len, max_tokens, match):
    s = scheduler(num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match=match): s.add(seq(0, prompt_len, max_tokens))
    assert not s.has_unfinished()


@pytest.mark.parametrize("prompt_len, max_tokens, num_blocks", [(64, 1, 16), (30, 3, 8)])
def test_the_last_token_needs_no_room(prompt_len, max_tokens, num_blocks):
    "A prompt of max_model_len tokens samples one (vLLM's rule); the cache holds all but the last token, so 33 tokens fit in 32 slots."
    s = scheduler(num_blocks=num_blocks, block_size=4)
    s.add(seq(0, prompt_len, max_tokens))
    while s.has_unfinished(): step(s)
    assert s.blocks.num_free_blocks == num_blocks


def test_abort_in_every_state():
    s = scheduler(num_blocks=16, max_num_seqs=1)
    for i in range(2): s.add(seq(i, 6))
    step(s)  # 0 runs, 1 waits
    assert s.abort(1).finish_reason == "abort" and s.num_waiting == 0
    used = s.blocks.num_used_blocks
    assert used > 0 and s.abort(0).finish_reason == "abort" and s.blocks.num_free_blocks == 16
    assert s.abort(0) is None and s.abort("never") is None
    assert s.schedule().seqs == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_num_batched_tokens=100 is below max_model_len=200"):
        SchedulerConfig(max_num_batched_tokens=100, max_model_len=200)
    with pytest.raises(ValueError, match="max_num_seqs=0"): SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="watermark"): scheduler(watermark=1.5)
    with pytest.raises(ValueError, match="empty"): Sequence(0, [])
    s = scheduler()
    s.add(seq(0, 4))
    with pytest.raises(ValueError, match="already scheduled"): s.add(seq(0, 4))
    with pytest.raises(ValueError, match="only a running or preempted sequence"): s.finish(s.seqs[0], "stop")
    out = s.schedule()
    s.update(out, [5])
    with pytest.raises(ValueError, match="recorded already"): s.update(out, [6])  # would append a token no slot holds
    assert s.seqs[0].output_token_ids == [5] and s.seqs[0].num_in_flight == 0
    a = s.schedule(); b = s.schedule()  # async scheduling: two steps in flight
    s.update(a, [7])
    with pytest.raises(ValueError, match="recorded already"): s.update(a, [7])
    s.update(b, [8])
    assert s.seqs[0].output_token_ids == [5, 7, 8]
    with pytest.raises(ValueError, match="reason=12345: expected 'stop', 'length' or 'abort'"): s.finish(s.seqs[0], 12345)


def test_a_sequence_that_cannot_be_allocated_stays_waiting():
    "Two schedulers over one pool, one sequence id: that allocation fails; the sequence still waits, those before it run."
    blocks = BlockManager(num_blocks=16, block_size=4)
    first, second = (Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), blocks)
                     for _ in range(2))
    first.add(seq(1, 4)); second.add(seq(0, 4)); second.add(seq(1, 4))
    first.schedule()
    with pytest.raises(ValueError): second.schedule()
    assert [q.seq_id for q in second.waiting] == [1] and [q.seq_id for q in second.running] == [0]
    assert second.seqs[0].block_table == blocks.block_tables[0]


def test_trace_records_steps():
    s = scheduler(num_blocks=16, trace=True)
    s.add(seq(0, 4, max_tokens=2))
    step(s); step(s)
    assert [(t.step, t.is_prefill, t.seq_ids, t.finished) for t in s.trace] == [(0, True, [0], []), (1, False, [0], [0])]



@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 8), st.integers(0, 8)), min_size=1, max_size=8),
       st.integers(0, 6), st.sampled_from([1, 4, 16]))
def test_one_step_lag_finishes_everything_within_max_tokens(requests, extra_blocks, block_size):
    "Async scheduling: each step's tokens come back only after the next step is scheduled, so stops land one step late."
    s = scheduler(blocks_needed(48, block_size) + extra_blocks, block_size, 4, 48, 48)
    for i, (p, m, _) in enumerate(requests): s.add(seq(i, p, m))
    stop_at = {i: stop for i, (_, _, stop) in enumerate(requests)}  # a "stop token" after this many tokens (0: never)
    pending, steps = None, 0
    while s.has_unfinished() or pending:
        out = s.schedule()
        for q in out.seqs: assert q.num_output_tokens + q.num_in_flight <= q.params.max_tokens
        if pending:  # the previous step's tokens arrive while this one runs
            was_finished = [q.is_finished for q in pending.seqs]
            s.update(pending, [0] * len(pending.seqs))
            for q, skip in zip(pending.seqs, was_finished):
                if not skip and q.num_output_tokens in (q.params.max_tokens, stop_at[q.seq_id]): s.finish(q, "stop")
        pending = out if out.seqs else None
        steps += 1
        assert steps < 2000, "no progress"
    assert s.blocks.num_free_blocks == s.blocks.num_blocks and all(q.num_in_flight == 0 for q in s.seqs.values())
