import random

import pytest
from hypothesis import Phase, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from nanoserve.block_manager import BlockManager, OutOfBlocks, blocks_needed


def check_invariants(bm: BlockManager, lens: dict):
    "The allocator's invariants; `lens` is the test's own record of each live sequence's length."
    holders = [blk for table in bm.block_tables.values() for blk in table]
    assert len(holders) == len(set(holders)), "a block is in two block tables"
    assert all(bm.ref_counts[blk] == holders.count(blk) for blk in range(bm.num_blocks)), "ref count != tables holding it"
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks and bm.num_used_blocks == len(holders)
    assert len(set(bm.free_block_ids)) == bm.num_free_blocks and not set(bm.free_block_ids) & set(holders)
    assert {s: bm.num_tokens(s) for s in bm.block_tables} == lens
    assert all(len(bm.block_table(s)) == blocks_needed(n, bm.block_size) for s, n in lens.items())
    slots = [slot for s in lens for slot in bm.slot_mapping(s)]
    assert len(slots) == len(set(slots)) and all(0 <= x < bm.num_blocks * bm.block_size for x in slots)
    assert bm.usage == pytest.approx(bm.num_used_blocks / bm.num_blocks)


class BlockManagerMachine(RuleBasedStateMachine):
    "Random allocate / append_slot / free programs, checked after every step."
    manager = BlockManager

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 5))
    def setup(self, num_blocks, block_size):
        self.bm, self.lens, self.next_id = self.manager(num_blocks, block_size), {}, 0

    @rule(num_tokens=st.integers(1, 24))
    def allocate(self, num_tokens):
        free, sid = self.bm.num_free_blocks, self.next_id
        self.next_id += 1
        if self.bm.can_allocate(num_tokens):
            table = self.bm.allocate(sid, num_tokens)
            assert len(table) == free - self.bm.num_free_blocks == blocks_needed(num_tokens, self.bm.block_size)
            self.lens[sid] = num_tokens
        else:
            assert blocks_needed(num_tokens, self.bm.block_size) > free
            with pytest.raises(OutOfBlocks):
                self.bm.allocate(sid, num_tokens)
            assert sid not in self.bm and self.bm.num_free_blocks == free

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def append(self, data):
        sid = data.draw(st.sampled_from(sorted(self.lens)))
        if self.bm.can_append(sid):
            slot = self.bm.append_slot(sid)
            self.lens[sid] += 1
            assert slot == self.bm.slot_mapping(sid, self.lens[sid] - 1)[0]
        else:
            assert self.lens[sid] % self.bm.block_size == 0 and self.bm.num_free_blocks == 0
            with pytest.raises(OutOfBlocks):
                self.bm.append_slot(sid)
            assert self.bm.num_tokens(sid) == self.lens[sid]

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.lens)))
        self.bm.free(sid)
        del self.lens[sid]

    @invariant()
    def consistent(self):
        check_invariants(self.bm, self.lens)

    def teardown(self):
        for sid in list(self.lens):
            self.bm.free(sid)
        assert self.bm.num_free_blocks == self.bm.num_blocks and not any(self.bm.ref_counts) and self.bm.usage == 0


def test_state_machine():
    run_state_machine_as_test(BlockManagerMachine, settings=settings(max_examples=150, stateful_step_count=50, deadline=None))


# a bug must be found; shrinking it to a minimal program is not needed here and takes long
TRAP_SETTINGS = settings(max_examples=200, stateful_step_count=40, database=None, deadline=None,
                         phases=[Phase.generate], report_multiple_bugs=False)


def test_trap_floor_instead_of_ceil_is_found():
    class FloorBlockManager(BlockManager):
        def can_allocate(self, num_tokens): return num_tokens // self.block_size <= self.num_free_blocks

    class FloorMachine(BlockManagerMachine):
        manager = FloorBlockManager

    with pytest.raises(OutOfBlocks):
        run_state_machine_as_test(FloorMachine, settings=TRAP_SETTINGS)


def test_trap_leaky_free_is_found():
    class LeakyBlockManager(BlockManager):  # forgets to return the last block of a sequence
        def free(self, seq_id):
            table = self.block_table(seq_id)
            super().free(seq_id)
            if len(table) > 1: self.free_block_ids.remove(table[-1])

    class LeakyMachine(BlockManagerMachine):
        manager = LeakyBlockManager

    with pytest.raises(AssertionError):
        run_state_machine_as_test(LeakyMachine, settings=TRAP_SETTINGS)


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(1, 40), block_size=st.integers(1, 17), seed=st.integers(0, 2**32 - 1))
def test_random_interleaved_programs(num_blocks, block_size, seed):
    "A long random program over many sequences: decode in round-robin, free at random, admit when possible."
    rng, bm, lens = random.Random(seed), BlockManager(num_blocks, block_size), {}
    for sid in range(300):
        n = rng.randint(1, 3 * block_size + 1)
        if bm.can_allocate(n):
            bm.allocate(sid, n); lens[sid] = n
        for s in list(lens):
            if rng.random() < 0.1:
                bm.free(s); del lens[s]
            elif bm.can_append(s):
                bm.append_slot(s); lens[s] += 1
        check_invariants(bm, lens)
    for s in list(lens): bm.free(s)
    assert bm.num_free_blocks == num_blocks and sorted(bm.free_block_ids) == list(range(num_blocks))


@pytest.mark.parametrize("n, b, want", [(1, 1, 1), (1, 16, 1), (16, 16, 1), (17, 16, 2), (32, 16, 2), (33, 16, 3), (0, 4, 0)])
def test_blocks_needed(n, b, want):
    assert blocks_needed(n, b) == want


def test_slots_and_block_boundaries():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.allocate("a", 4) == [0]  # exactly one full block
    assert bm.slot_mapping("a") == [0, 1, 2, 3]
    assert bm.can_append("a") and bm.append_slot("a") == 4 and bm.block_table("a") == [0, 1]  # 5th token opens block 1
    assert bm.allocate("b", 5) == [2, 3]
    assert [bm.append_slot("a") for _ in range(3)] == [5, 6, 7]  # fills block 1 without a new block
    assert bm.append_slot("a") == 16 and bm.block_table("a") == [0, 1, 4]  # 9th token: next free block is 4
    assert bm.slot_mapping("a", 3, 6) == [3, 4, 5] and bm.slot_mapping("a", 9, 9) == []
    assert bm.slot_mapping("b") == [8, 9, 10, 11, 12]
    assert bm.num_tokens("a") == 9 and bm.num_used_blocks == 5 and bm.num_free_blocks == 1 and bm.usage == 5 / 6
    assert "a" in bm and "z" not in bm and "used=5" in repr(bm)


def test_block_table_is_a_copy():
    bm = BlockManager(4, 2)
    table = bm.allocate(0, 3)
    table.append(99); bm.block_table(0).append(98)
    assert bm.block_table(0) == [0, 1]


def test_free_returns_blocks_to_the_end_of_the_free_list():
    bm = BlockManager(num_blocks=5, block_size=2)
    bm.allocate("a", 4); bm.allocate("b", 1)
    bm.free("a")
    assert list(bm.free_block_ids) == [3, 4, 1, 0] and bm.ref_counts == [0, 0, 1, 0, 0]
    assert bm.allocate("c", 3) == [3, 4]  # freed blocks are reused last


def test_can_append_several_tokens():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", 6)  # blocks 0, 1; 2 slots left in block 1; 1 free block
    assert bm.can_append("a", 2) and bm.can_append("a", 6) and not bm.can_append("a", 7)


def test_out_of_blocks():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert not bm.can_allocate(9) and bm.can_allocate(8)
    with pytest.raises(OutOfBlocks, match=r"needs 3 blocks but only 2 of 2 are free"):
        bm.allocate("big", 9)
    assert "big" not in bm and bm.num_free_blocks == 2
    bm.allocate("a", 8)
    assert not bm.can_append("a") and not bm.can_allocate(1)
    with pytest.raises(OutOfBlocks, match="token 8 needs a new block"):
        bm.append_slot("a")
    assert bm.num_tokens("a") == 8 and bm.block_table("a") == [0, 1]
    assert issubclass(OutOfBlocks, RuntimeError) and not issubclass(OutOfBlocks, ValueError)


@pytest.mark.parametrize("kwargs, name", [(dict(num_blocks=0, block_size=16), "num_blocks"),
                                          (dict(num_blocks=-3, block_size=16), "num_blocks"),
                                          (dict(num_blocks=8, block_size=0), "block_size"),
                                          (dict(num_blocks=8, block_size=2.0), "block_size"),
                                          (dict(num_blocks=True, block_size=16), "num_blocks"),
                                          (dict(num_blocks="8", block_size=16), "num_blocks")])
def test_constructor_validates(kwargs, name):
    with pytest.raises(ValueError, match=f"{name}=.*positive integer"):
        BlockManager(**kwargs)


def test_numpy_integers_are_accepted():
    np = pytest.importorskip("numpy")
    bm = BlockManager(np.int64(4), np.int32(2))
    assert bm.allocate(0, np.int64(3)) == [0, 1]


def test_bad_calls_are_value_errors():
    bm = BlockManager(4, 4)
    bm.allocate("a", 3)
    with pytest.raises(ValueError, match="already holds blocks"): bm.allocate("a", 1)
    with pytest.raises(ValueError, match="num_tokens=0"): bm.allocate("b", 0)
    with pytest.raises(ValueError, match="num_tokens=-1"): bm.can_allocate(-1)
    with pytest.raises(ValueError, match="num_tokens=0"): bm.can_append("a", 0)
    for method in (bm.free, bm.append_slot, bm.can_append, bm.block_table, bm.num_tokens, bm.slot_mapping):
        with pytest.raises(ValueError, match="seq_id='nope' holds no blocks"): method("nope")
    with pytest.raises(ValueError, match="end=4"): bm.slot_mapping("a", 0, 4)
    with pytest.raises(ValueError, match="start=2, end=1"): bm.slot_mapping("a", 2, 1)
    bm.free("a")
    with pytest.raises(ValueError, match="already freed"): bm.free("a")
    assert bm.num_free_blocks == 4


def test_any_hashable_seq_id():
    bm = BlockManager(8, 2)
    for sid in (0, "req-1", ("client", 7)):
        bm.allocate(sid, 3)
    assert len({tuple(bm.block_table(s)) for s in (0, "req-1", ("client", 7))}) == 3
