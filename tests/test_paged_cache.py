import itertools, random

import pytest, torch

from nanoserve.attention import causal_attention
from nanoserve.block_manager import BlockManager, OutOfBlocks, blocks_needed
from nanoserve.generate import generate
from nanoserve.loader import load_model
from nanoserve.paged_cache import (PagedAttention, PagedAttentionMetadata, PagedKVCache, block_bytes, forward_paged,
                                   gather_kv, paged_attention_ref, store_kv_ref)
from nanoserve.sampling import SamplingParams
from nanoserve.testing import hf_model, tiny_model_dir
from nanoserve.tokenizer import load_tokenizer


def ragged_batch(block_size, group, num_kv_heads=2, head_dim=16, seed=0, pad=-1, dtype=torch.float32):
    "Arguments of paged_attention_ref for a random mixed batch over a NaN-filled, scattered pool; expected output per sequence."
    rng, g, b = random.Random(seed), torch.Generator().manual_seed(seed), block_size
    specs = [(b, b), (b + 1, 1), (2 * b + 1, 2 * b + 1), (2 * b, 1), (2 * b + 1, b + 1), (1, 1), (b + 1, b + 1), (b, 1)]
    specs += [(n, rng.choice([1, n, rng.randint(1, n)])) for n in (rng.randint(1, 3 * b + 1) for _ in range(3))]
    rng.shuffle(specs)
    need = [blocks_needed(n, b) for n, _ in specs]
    perm = torch.randperm(sum(need) + 2, generator=g).tolist()
    tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(len(specs))]
    k_cache = torch.full((len(perm), b, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    ks, vs, qs, slots, expected = [], [], [], [], []
    for (n, q_len), table in zip(specs, tables):
        k, v = torch.randn(2, n, num_kv_heads, head_dim, generator=g).to(dtype)
        q = torch.randn(q_len, num_kv_heads * group, head_dim, generator=g).to(dtype)
        ks.append(k); vs.append(v); qs.append(q); slots += [table[p // b] * b + p % b for p in range(n)]
        expected.append(causal_attention(q.float(), k.float(), v.float(), head_dim**-0.5))
    junk = torch.randn(1, num_kv_heads, head_dim, generator=g).to(dtype)
    store_kv_ref(torch.cat(ks + [junk]), torch.cat(vs + [junk]), k_cache, v_cache, torch.tensor(slots + [-1]))
    width = max(need) + 2
    block_tables = torch.tensor([t + [pad] * (width - len(t)) for t in tables], dtype=torch.int32)
    context_lens = torch.tensor([n for n, _ in specs], dtype=torch.int32)
    cu = torch.tensor([0, *itertools.accumulate(q for _, q in specs)], dtype=torch.int32)
    return (torch.cat(qs), k_cache, v_cache, block_tables, context_lens, cu, head_dim**-0.5), torch.cat(expected), specs


# ---- the storage

def test_cache_shapes_and_size():
    c = PagedKVCache(num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    assert c.k.shape == c.v.shape == (3, 5, 4, 2, 8) and c.k.dtype == torch.bfloat16
    assert (c.num_layers, c.num_blocks, c.block_size) == (3, 5, 4)
    assert c.nbytes == 2 * 3 * 5 * 4 * 2 * 8 * 2
    assert c.k[1].stride() == (4 * 2 * 8, 8, 4 * 8, 1)  # (block, token, head, dim): a head's 4 tokens of a block side by side
    assert "num_blocks=5" in repr(c)


def test_from_config_and_block_bytes():
    model = load_model(tiny_model_dir("llama"))
    cfg = model.config
    c = PagedKVCache.from_config(cfg, num_blocks=7, block_size=16, dtype=torch.bfloat16)
    assert c.k.shape == (cfg.num_hidden_layers, 7, 16, cfg.num_key_value_heads, cfg.head_dim)
    assert c.nbytes == 7 * block_bytes(cfg, 16, torch.bfloat16)
    assert block_bytes(cfg, 16, torch.float32) == 2 * block_bytes(cfg, 16, torch.bfloat16)


@pytest.mark.parametrize("name", ["num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_cache_validates(name, bad):
    sizes = dict(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=f"{name}=.*positive integer"):
        PagedKVCache(**{**sizes, name: bad})


# ---- store

def test_store_writes_slots_and_skips_minus_one():
    kc, vc = torch.zeros(4, 2, 1, 3), torch.zeros(4, 2, 1, 3)
    k = torch.arange(1.0, 13.0).view(4, 1, 3)
    store_kv_ref(k, -k, kc, vc, torch.tensor([5, -1, 0, -1]))
    flat_k, flat_v = kc.view(8, 1, 3), vc.view(8, 1, 3)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[0], k[2]) and torch.equal(flat_v[5], -k[0])
    assert flat_k[[1, 2, 3, 4, 6, 7]].eq(0).all() and flat_v[[1, 2, 3, 4, 6, 7]].eq(0).all()  # padding rows landed nowhere


def test_store_into_the_caches_head_major_pool():
    "store_kv_ref writes through the strides of PagedKVCache's pools, which are not contiguous in (block, token, head, dim)."
    cache = PagedKVCache(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_dim=5)
    k = torch.randn(6, 2, 5)
    slots = torch.tensor([11, 0, -1, 5, 4, 7])
    store_kv_ref(k, -k, cache.k[1], cache.v[1], slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(cache.k[1, s // 4, s % 4], k[t]) and torch.equal(cache.v[1, s // 4, s % 4], -k[t])
    assert cache.k[0].eq(0).all() and cache.k[1].ne(0).any(dim=-1).sum() == 2 * 5  # 5 tokens x 2 heads, layer 0 untouched


def test_store_all_padding_and_empty():
    kc, vc = torch.zeros(2, 2, 1, 3), torch.zeros(2, 2, 1, 3)
    store_kv_ref(torch.ones(3, 1, 3), torch.ones(3, 1, 3), kc, vc, torch.full((3,), -1))
    store_kv_ref(torch.ones(0, 1, 3), torch.ones(0, 1, 3), kc, vc, torch.zeros(0, dtype=torch.long))
    assert kc.eq(0).all() and vc.eq(0).all()


def test_store_casts_to_cache_dtype():
    kc, vc = torch.zeros(2, 2, 2, 4, dtype=torch.bfloat16), torch.zeros(2, 2, 2, 4, dtype=torch.bfloat16)
    k = torch.randn(3, 2, 4)
    store_kv_ref(k, k, kc, vc, torch.tensor([3, 0, 1], dtype=torch.int32))
    assert torch.equal(kc.view(4, 2, 4)[[3, 0, 1]], k.bfloat16())


def test_store_errors():
    kc, vc = torch.zeros(2, 2, 1, 3), torch.zeros(2, 2, 1, 3)
    k = torch.ones(2, 1, 3)
    with pytest.raises(ValueError, match=r"slot_mapping values must be -1 \(skip\) or in \[0, 4\)"):
        store_kv_ref(k, k, kc, vc, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="slot_mapping values"):
        store_kv_ref(k, k, kc, vc, torch.tensor([-2, 0]))
    with pytest.raises(ValueError, match=r"slot_mapping must be \(2,\)"):
        store_kv_ref(k, k, kc, vc, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"k, v must be \(T, K, D\) = \(T, 1, 3\)"):
        store_kv_ref(torch.ones(2, 2, 3), torch.ones(2, 2, 3), kc, vc, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="v_cache"):
        store_kv_ref(k, k, kc, torch.zeros(3, 2, 1, 3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="k_cache must be one layer's pool"):
        store_kv_ref(k, k, torch.zeros(1, 2, 2, 1, 3), torch.zeros(1, 2, 2, 1, 3), torch.tensor([0, 1]))
    for slots in (torch.tensor([0.9, 1.5]), torch.tensor([True, False])):  # would be read as slots 0, 1 and 1, 0
        with pytest.raises(ValueError, match=f"slot_mapping must hold integers, got {slots.dtype}"): store_kv_ref(k, k, kc, vc, slots)
    assert kc.eq(0).all()


# ---- gather

@pytest.mark.parametrize("b", [1, 3, 4])
def test_gather_inverts_store(b):
    g = torch.Generator().manual_seed(b)
    pool = torch.zeros(12, b, 2, 4)
    for n in (1, b, b + 1, 2 * b, 2 * b + 1):
        table = torch.randperm(12, generator=g)[:blocks_needed(n, b)].tolist()
        k = torch.randn(n, 2, 4, generator=g)
        store_kv_ref(k, k, pool, pool.clone(), torch.tensor([table[p // b] * b + p % b for p in range(n)]))
        assert torch.equal(gather_kv(pool, torch.tensor(table + [-1, -1], dtype=torch.int32), n), k)
        assert torch.equal(gather_kv(pool, table, n), k)  # a list works too
    assert gather_kv(pool, [-1], 0).shape == (0, 2, 4) and gather_kv(pool, [], 0).shape == (0, 2, 4)


def test_gather_errors():
    pool = torch.zeros(4, 2, 1, 3)
    with pytest.raises(ValueError, match="context_len=5 needs 3 valid block ids"):
        gather_kv(pool, torch.tensor([0, 1]), 5)
    with pytest.raises(ValueError, match="needs 2 valid block ids"):
        gather_kv(pool, torch.tensor([0, -1, 2]), 3)
    with pytest.raises(ValueError, match=r"in \[0, 4\)"):
        gather_kv(pool, torch.tensor([4]), 1)
    with pytest.raises(ValueError, match="block_table must hold integers, got torch.float32"):
        gather_kv(pool, [0.7, 1.2], 3)


# ---- paged attention

@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_paged_attention_equals_contiguous_on_ragged_batches(block_size, group):
    for seed, pad in [(block_size * 10 + group, -1), (block_size * 10 + group + 100, 0)]:
        args, expected, specs = ragged_batch(block_size, group, seed=seed, pad=pad)
        assert {q == n for n, q in specs} == {True, False} and any(1 < q < n for n, q in specs)  # mixed rows
        out = paged_attention_ref(*args)
        assert out.shape == expected.shape and not out.isnan().any()
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_paged_attention_one_kv_head_and_several_heads():
    for K, G in [(1, 1), (1, 8), (4, 2)]:
        args, expected, _ = ragged_batch(4, G, num_kv_heads=K, head_dim=8, seed=K * 10 + G)
        torch.testing.assert_close(paged_attention_ref(*args), expected, atol=1e-6, rtol=0)


def test_paged_attention_bf16_computes_in_float32():
    args, expected, _ = ragged_batch(16, 2, seed=5, dtype=torch.bfloat16)  # expected: fp32 math on the bf16 values
    out = paged_attention_ref(*args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=0)
    assert (out.float() - expected.bfloat16().float()).abs().max() <= 2 ** -7  # one bf16 rounding of the fp32 result


def test_sequence_without_queries_is_skipped():
    (q, kc, vc, bt, lens, cu, scale), expected, specs = ragged_batch(4, 2, seed=1)
    bt2 = torch.cat([bt[:1], bt])  # a sequence with context but no new queries this step
    lens2, cu2 = torch.cat([lens[:1], lens]), torch.cat([cu[:1], cu])
    torch.testing.assert_close(paged_attention_ref(q, kc, vc, bt2, lens2, cu2, scale), expected, atol=1e-6, rtol=0)


def test_trap_swapped_blocks_change_prefill_rows():
    (q, kc, vc, bt, lens, cu, scale), expected, specs = ragged_batch(4, 2, seed=3)
    i = specs.index((9, 9))
    swapped = bt.clone(); swapped[i, [0, 1]] = swapped[i, [1, 0]]
    err = (paged_attention_ref(q, kc, vc, swapped, lens, cu, scale) - expected)[cu[i]:cu[i + 1]].abs().max()
    assert err > 0.1


def test_trap_queries_aligned_to_the_start_would_differ():
    "Continuation rows are the LAST q_len positions: attending as if they were the first gives other outputs."
    (q, kc, vc, bt, lens, cu, scale), expected, specs = ragged_batch(4, 1, seed=4)
    i = next(i for i, (n, q_len) in enumerate(specs) if 1 < q_len < n)
    n, q_len = specs[i]
    k, v = gather_kv(kc, bt[i], n), gather_kv(vc, bt[i], n)
    top_left = causal_attention(q[cu[i]:cu[i + 1]], k[:q_len], v[:q_len], scale)
    assert (top_left - expected[cu[i]:cu[i + 1]]).abs().max() > 0.1


def test_paged_attention_errors():
    (q, kc, vc, bt, lens, cu, scale), _, specs = ragged_batch(4, 2, seed=2)
    call = lambda **kw: paged_attention_ref(**{**dict(q=q, k_cache=kc, v_cache=vc, block_tables=bt, context_lens=lens,
                                                      cu_seqlens_q=cu, scale=scale), **kw})
    with pytest.raises(ValueError, match="cu_seqlens_q must rise from 0 to T"):
        call(cu_seqlens_q=cu + 1)
    with pytest.raises(ValueError, match="cu_seqlens_q must rise"):
        call(cu_seqlens_q=cu.flip(0))
    with pytest.raises(ValueError, match=r"context_lens must be"):
        call(context_lens=lens[:-1])
    with pytest.raises(ValueError, match="at least its query length"):
        call(context_lens=torch.zeros_like(lens))
    with pytest.raises(ValueError, match="fit its block table"):
        call(context_lens=lens.clone().fill_(bt.shape[1] * 4 + 1))
    with pytest.raises(ValueError, match="H a multiple of K=2"):
        call(q=q[:, :3])
    with pytest.raises(ValueError, match=r"q must be \(T, H, D=16\)"):
        call(q=q[..., :8])
    with pytest.raises(ValueError, match=r"block_tables must be \(B, max_blocks\)"):
        call(block_tables=bt[0])
    with pytest.raises(ValueError, match="v_cache"):
        call(v_cache=vc[:-1])
    bad = bt.clone(); bad[specs.index((9, 9)), 1] = -1
    with pytest.raises(ValueError, match="block ids a context uses must be in"):
        call(block_tables=bad)
    for name, value in (("block_tables", bt.float()), ("context_lens", lens.float()), ("cu_seqlens_q", cu.float())):
        with pytest.raises(ValueError, match=f"{name} must hold integers, got torch.float32"): call(**{name: value})


# ---- metadata and the model

def test_metadata_from_block_manager():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 6); bm.allocate("b", 3); bm.append_slot("a")
    for _ in range(2): bm.append_slot("b")
    m = PagedAttentionMetadata.from_block_manager(bm, ["a", "b"], [1, 5])  # a decodes 1 token, b prefills 5
    assert m.slot_mapping.tolist() == [6, 8, 9, 10, 11, 12] and m.slot_mapping.dtype == torch.int64
    assert m.block_tables.tolist() == [[0, 1], [2, 3]] and m.block_tables.dtype == torch.int32
    assert m.context_lens.tolist() == [7, 5] and m.cu_seqlens_q.tolist() == [0, 1, 6]
    assert m.positions().tolist() == [6, 0, 1, 2, 3, 4]
    bm.allocate("c", 9)
    m = PagedAttentionMetadata.from_block_manager(bm, ["c", "a"], [4, 7])
    assert m.block_tables.tolist() == [[4, 5, 6], [0, 1, -1]] and m.positions().tolist() == [5, 6, 7, 8, *range(7)]
    with pytest.raises(ValueError, match="1 seq_ids but 2 counts of new tokens"):
        PagedAttentionMetadata.from_block_manager(bm, ["a"], [1, 2])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_forward_paged_equals_transformers(arch, block_size):
    model, hf = load_model(tiny_model_dir(arch)), hf_model(tiny_model_dir(arch))
    ids = torch.randint(0, 512, (21,), generator=torch.Generator().manual_seed(block_size))
    n = blocks_needed(21, block_size)
    cache, bm = PagedKVCache.from_config(model.config, n + 3, block_size), BlockManager(n + 3, block_size)
    bm.allocate("other", 1 + 2 * block_size)  # another sequence first, so that ours does not start at block 0
    with torch.no_grad():
        rows = [forward_paged(model, ids[:9], cache, bm, "s"), forward_paged(model, ids[9:14], cache, bm, "s")]  # prefill, continuation
        rows += [forward_paged(model, ids[i:i + 1], cache, bm, "s") for i in range(14, 21)]  # decode
        torch.testing.assert_close(torch.cat(rows), hf(ids[None]).logits[0], atol=1e-5, rtol=0)
    assert bm.num_tokens("s") == 21 and len(bm.block_table("s")) == n


def test_batched_forward_through_the_seam():
    model = load_model(tiny_model_dir("llama"))
    bm, cache = BlockManager(num_blocks=12, block_size=4), PagedKVCache.from_config(model.config, 12, 4)
    g = torch.Generator().manual_seed(2)
    seqs = {"a": torch.randint(0, 512, (8,), generator=g), "b": torch.randint(0, 512, (13,), generator=g)}
    def step(new):
        for s, t in new.items():
            if s in bm: [bm.append_slot(s) for _ in t]
            else: bm.allocate(s, len(t))
        meta = PagedAttentionMetadata.from_block_manager(bm, list(new), [len(t) for t in new.values()])
        logits = model(torch.cat(list(new.values())), meta.positions(), attention=PagedAttention(cache, meta))
        return dict(zip(new, logits.split([len(t) for t in new.values()])))
    with torch.no_grad():
        first = step({"a": seqs["a"][:-1], "b": seqs["b"][:-1]})
        second = step({"b": seqs["b"][-1:], "a": seqs["a"][-1:]})  # the order of sequences in a step is free
        for s, t in seqs.items():
            torch.testing.assert_close(torch.cat([first[s], second[s]]), model(t), atol=1e-5, rtol=0)


def test_forward_paged_out_of_blocks_changes_nothing():
    model = load_model(tiny_model_dir("llama"))
    cache, bm = PagedKVCache.from_config(model.config, 2, 4), BlockManager(2, 4)
    with torch.no_grad():
        with pytest.raises(OutOfBlocks):
            forward_paged(model, torch.arange(9), cache, bm)
        assert 0 not in bm and bm.num_free_blocks == 2
        forward_paged(model, torch.arange(6), cache, bm)
        with pytest.raises(OutOfBlocks, match="cannot add 3 tokens"):
            forward_paged(model, torch.arange(3), cache, bm)
        assert bm.num_tokens(0) == 6
        forward_paged(model, torch.arange(2), cache, bm)
        assert bm.num_tokens(0) == 8 and bm.num_free_blocks == 0


@pytest.fixture(scope="module")
def smol():
    return load_model(), load_tokenizer()


def greedy_paged(model, prompt_ids, max_tokens, stop_token_ids, block_size, num_blocks):
    cache = PagedKVCache.from_config(model.config, num_blocks, block_size, model.lm_head.weight.dtype)
    bm, out = BlockManager(num_blocks, block_size), []
    with torch.no_grad():
        logits = forward_paged(model, torch.tensor(prompt_ids), cache, bm, "req")
        while len(out) < max_tokens:
            out.append(logits[-1].argmax().item())
            if out[-1] in stop_token_ids: break
            logits = forward_paged(model, torch.tensor(out[-1:]), cache, bm, "req")
    return out, bm


def test_greedy_paged_equals_contiguous_generate_on_default_model(smol):
    model, tok = smol
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=True)
    contiguous = generate(model, tok, prompt, SamplingParams(temperature=0, max_tokens=40)).token_ids
    assert "Paris" in tok.decode(contiguous)
    paged, bm = greedy_paged(model, prompt, 40, tok.stop_token_ids, block_size=4, num_blocks=16)  # 12 blocks used
    assert paged == contiguous
    assert bm.num_tokens("req") == len(prompt) + len(paged) - 1  # the last token is sampled, never fed back
