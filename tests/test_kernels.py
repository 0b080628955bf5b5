"""The Triton kernels of chapter 9 against chapter 8b's reference.

Without a CUDA GPU they run in Triton's CPU interpreter (conftest.py sets TRITON_INTERPRET=1 before triton is
imported), on small shapes; with one, the same tests run compiled, and the `gpu` tests add bf16 at real model
shapes. Tolerances: float32 1e-5 absolute; float16 and bfloat16 2e-2 absolute and relative (one unit in the last
place of a bf16 output of magnitude 2 is 2**-7 = 0.008; on a GPU the softmax weights are also rounded to bf16
before they multiply the values, as in FlashAttention). Every output tensor starts filled with NaN, and so does
every cache slot a batch does not write, so an element that is not written, or a slot read that should not be,
fails the comparison.
"""
import itertools

import pytest
import torch

import nanoserve.kernels as kernels
from nanoserve.kernels import (TritonPagedAttention, choose_num_splits, decode_attention_bytes, interpreting,
                               paged_decode_attention, paged_prefill_attention, store_kv)
from nanoserve.paged_cache import PagedAttention, PagedAttentionMetadata, PagedKVCache, paged_attention_ref, store_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-2, rtol=2e-2),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def paged_batch(context_lens, q_lens, H, K, D, block_size, dtype=torch.float32, seed=0, device=DEVICE, pad=-1,
                head_major=False):
    "A random paged batch (q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q), stored by the reference."
    g = torch.Generator().manual_seed(seed)
    need = [-(-S // block_size) for S in context_lens]
    perm = torch.randperm(sum(need) + 3, generator=g).tolist()  # scattered blocks; three belong to nobody
    tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(len(need))]
    if head_major:  # the layout of the engine's PagedKVCache (chapter 8b)
        pools = PagedKVCache(1, len(perm), block_size, K, D, dtype, device)
        k_cache, v_cache = pools.k[0].fill_(float("nan")), pools.v[0].fill_(float("nan"))
    else:  # token-major: (num_blocks, block_size, K, D) contiguous
        k_cache = torch.full((len(perm), block_size, K, D), float("nan"), dtype=dtype, device=device)
        v_cache = k_cache.clone()
    slots = [t[p // block_size] * block_size + p % block_size for t, S in zip(tables, context_lens) for p in range(S)]
    k, v = (torch.randn(len(slots), K, D, generator=g).to(dtype).to(device) for _ in range(2))
    store_kv_ref(k, v, k_cache, v_cache, torch.tensor(slots, device=device))
    width = max(need) + 1
    i32 = dict(dtype=torch.int32, device=device)
    block_tables = torch.tensor([t + [pad] * (width - len(t)) for t in tables], **i32)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], **i32)
    q = torch.randn(sum(q_lens), H, D, generator=g).to(dtype).to(device)
    return q, k_cache, v_cache, block_tables, torch.tensor(context_lens, **i32), cu


def decode(q, k_cache, v_cache, block_tables, context_lens, num_splits=None, window=None):
    "paged_decode_attention into a NaN-poisoned output."
    out = torch.full_like(q, float("nan"))
    return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, q.shape[-1] ** -0.5, num_splits, out=out,
                                  window=window)


def prefill(q, k_cache, v_cache, block_tables, context_lens, cu, max_seqlen_q=None, window=None):
    "paged_prefill_attention into a NaN-poisoned output."
    out = torch.full_like(q, float("nan"))
    return paged_prefill_attention(q, k_cache, v_cache, block_tables, context_lens, cu, q.shape[-1] ** -0.5,
                                   max_seqlen_q=max_seqlen_q, out=out, window=window)


def reference(q, k_cache, v_cache, block_tables, context_lens, cu, window=None):
    return paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, cu, q.shape[-1] ** -0.5, window)


def boundary_lens(b):
    "Context lengths on and just past block boundaries, and a single token."
    return [b, b + 1, 2 * b, 2 * b + 1, 1, 3 * b - 1]


def test_interpreter_is_on_exactly_without_a_gpu():
    assert interpreting() == (not torch.cuda.is_available())


# ---- store_kv

@pytest.mark.parametrize("dtype,slot_dtype", [(torch.float32, torch.int64), (torch.bfloat16, torch.int32),
                                              (torch.float16, torch.int64)])
def test_store_kv_matches_reference(dtype, slot_dtype):
    g = torch.Generator().manual_seed(0)
    T, K, D, b = 37, 2, 64, 16  # 37 tokens: three store programs, the last one partly empty
    qkv = torch.randn(T, 6, D, generator=g).to(dtype).to(DEVICE)  # k and v as views of a fused projection
    k, v = qkv[:, 2:4], qkv[:, 4:6]
    slots = torch.randperm(8 * b, generator=g)[:T].to(slot_dtype)
    slots[[0, 5, 36]] = -1  # padding rows
    pools = [tuple(torch.full((8, b, K, D), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)) for _ in range(2)]
    store_kv(k, v, *pools[0], slots.to(DEVICE))
    store_kv_ref(k, v, *pools[1], slots.to(DEVICE))
    for ours, ref in zip(*pools):
        assert torch.equal(ours.isnan(), ref.isnan())
        assert torch.equal(ours.nan_to_num(), ref.nan_to_num())
    assert (~pools[0][0].isnan().all(-1).all(-1)).sum().item() == T - 3  # exactly the 34 real tokens were written


def test_store_kv_empty_is_a_no_op():
    pool = torch.zeros(2, 16, 1, 16, device=DEVICE)
    store_kv(torch.zeros(0, 1, 16, device=DEVICE), torch.zeros(0, 1, 16, device=DEVICE), pool, pool.clone(),
             torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert not pool.any()


# ---- decode

@pytest.mark.parametrize("G,D,block_size,dtype", [
    (1, 64, 16, torch.float32),
    (2, 128, 16, torch.float32),
    (3, 64, 32, torch.float16),
    (4, 64, 64, torch.bfloat16),
    (8, 128, 32, torch.float32),
    (4, 80, 16, torch.float32),  # a head dim that is not a power of two
])
def test_decode_matches_reference(G, D, block_size, dtype):
    lens = boundary_lens(block_size)
    K = 2 if G in (1, 2, 4) else 1  # interpreter time grows with the heads: several KV heads only where cheap
    args = paged_batch(lens, [1] * len(lens), G * K, K, D, block_size, dtype, seed=G * D + block_size)
    out = decode(*args[:5], num_splits=1)
    torch.testing.assert_close(out, reference(*args), **TOL[dtype])


def test_decode_splits_equal_one_split():
    lens = [1, 16, 17, 100, 129, 300]
    args = paged_batch(lens, [1] * len(lens), 4, 2, 64, 16, seed=1)
    one = decode(*args[:5], num_splits=1)
    torch.testing.assert_close(one, reference(*args), **TOL[torch.float32])
    for n in (2, 3, 7, None):  # 7: more splits than 64-key tiles in every sequence, so some splits are empty
        torch.testing.assert_close(decode(*args[:5], num_splits=n), one, atol=2e-6, rtol=1e-5)


def test_decode_block_table_padding_is_never_read():
    lens = boundary_lens(16)
    for pad in (0, 10**6):  # any padding value (-1 elsewhere): positions past a context are masked before their block id is read
        args = paged_batch(lens, [1] * len(lens), 4, 2, 64, 16, seed=2, pad=pad)
        torch.testing.assert_close(decode(*args[:5], num_splits=2), reference(*args), **TOL[torch.float32])


def test_kernels_on_the_head_major_pools_of_paged_kv_cache():
    "The kernels read and write through strides: on PagedKVCache's head-major pools they match the reference too."
    lens, q_lens = [16, 17, 33, 1, 70], [16, 1, 5, 1, 70]
    args = paged_batch(lens, q_lens, 4, 2, 64, 16, seed=7, head_major=True)
    assert args[1].stride()[1:] == (64, 16 * 64, 1)  # (token, head, dim): a head's 16 tokens side by side
    torch.testing.assert_close(prefill(*args), reference(*args), **TOL[torch.float32])
    dec = paged_batch(lens, [1] * len(lens), 4, 2, 64, 16, seed=8, head_major=True)
    for n in (1, 3):
        torch.testing.assert_close(decode(*dec[:5], num_splits=n), reference(*dec), **TOL[torch.float32])
    k, v = torch.randn(2, 9, 2, 64).to(DEVICE)
    slots = torch.tensor([3, 40, -1, 17, 0, 63, 16, 5, 41], device=DEVICE)
    ours, ref = (PagedKVCache(1, 4, 16, 2, 64, device=DEVICE) for _ in range(2))
    store_kv(k, v, ours.k[0], ours.v[0], slots)
    store_kv_ref(k, v, ref.k[0], ref.v[0], slots)
    assert torch.equal(ours.k, ref.k) and torch.equal(ours.v, ref.v) and ours.k.count_nonzero() == 8 * 2 * 64


class LaunchSpy:
    "Stands in for a Triton kernel: records each launch's grid and keyword arguments, then launches."
    def __init__(self, kernel): self.kernel, self.launches = kernel, []
    def __getitem__(self, grid):
        return lambda *a, **kw: self.launches.append((grid, kw)) or self.kernel[grid](*a, **kw)


def test_kernels_with_blocks_larger_than_their_tiles(monkeypatch):
    "Blocks of 256 tokens under 16-key tiles: each tile reads part of one block, and the tiles do not grow with the block."
    lens, q_lens = [1, 255, 256, 257, 600], [1, 100, 1, 257, 30]
    pre = paged_batch(lens, q_lens, 4, 2, 16, 256, seed=9)
    dec = paged_batch(lens, [1] * len(lens), 4, 2, 16, 256, seed=10)
    prefill_spy, decode_spy = LaunchSpy(kernels._prefill_kernel), LaunchSpy(kernels._decode_kernel)
    monkeypatch.setattr(kernels, "_prefill_kernel", prefill_spy)
    monkeypatch.setattr(kernels, "_decode_kernel", decode_spy)
    monkeypatch.setattr(kernels, "PREFILL_BLOCK_N", 16)
    monkeypatch.setattr(kernels, "decode_tile", lambda programs_per_sm, head_dim, cache_dtype=None: (16, 2, 2))
    torch.testing.assert_close(prefill(*pre), reference(*pre), **TOL[torch.float32])
    for n in (1, 3):
        torch.testing.assert_close(decode(*dec[:5], num_splits=n), reference(*dec), **TOL[torch.float32])
    assert [kw["BLOCK_N"] for _, kw in prefill_spy.launches + decode_spy.launches] == [16, 16, 16]


def test_decode_empty_batch():
    q, k_cache, v_cache, bt, lens, _ = paged_batch([5], [1], 4, 2, 64, 16)
    out = paged_decode_attention(q[:0], k_cache, v_cache, bt[:0], lens[:0], 0.125)
    assert out.shape == (0, 4, 64)


# ---- prefill

@pytest.mark.parametrize("G,D,block_size,dtype", [
    (1, 64, 16, torch.float32),
    (3, 128, 32, torch.bfloat16),
    (4, 64, 64, torch.float16),
    (8, 64, 16, torch.float32),
])
def test_prefill_matches_reference(G, D, block_size, dtype):
    b = block_size
    # fresh prompts (q = S), continuations after cached blocks (q < S, one longer than a 64-query tile),
    # a decode row (q = 1) and a sequence with no new tokens in this step (q = 0)
    lens = [b, b + 1, 2 * b + 1, 3 * b, 100, 90, 7]
    q_lens = [b, b + 1, b, 1, 70, 0, 7]
    K = 2 if G == 1 else 1
    args = paged_batch(lens, q_lens, G * K, K, D, b, dtype, seed=G + D + b)
    torch.testing.assert_close(prefill(*args), reference(*args), **TOL[dtype])


# ---- sliding windows (chapter 3): a query sees only the last `window` positions

WINDOWS = [1, 5, 16, 17, 64, 65, 10**6]  # one position, within a block, on and past block and tile boundaries, none cut


def test_decode_sliding_window_matches_reference():
    lens = [1, 5, 16, 17, 64, 65, 100, 200]
    args = paged_batch(lens, [1] * len(lens), 4, 2, 64, 16, seed=21)
    for window in WINDOWS:
        ref = reference(*args, window=window)
        for n in (1, 3, None):  # splits divide the window's positions, not the whole context
            torch.testing.assert_close(decode(*args[:5], num_splits=n, window=window), ref, **TOL[torch.float32],
                                       msg=f"window {window}, splits {n}")
    assert (reference(*args, window=16) - reference(*args)).abs().max() > 1e-2  # the window changes the answer


def test_prefill_sliding_window_matches_reference():
    # fresh prompts, continuations after cached blocks (one of more than a 64-query tile), a decode row, no new tokens
    lens, q_lens = [16, 33, 100, 150, 90, 40], [16, 33, 30, 70, 1, 0]
    args = paged_batch(lens, q_lens, 4, 2, 64, 16, seed=22)
    for window in WINDOWS:  # rows that see no key of a whole tile (window 1, 5) must not turn into NaN
        torch.testing.assert_close(prefill(*args, window=window), reference(*args, window=window), **TOL[torch.float32],
                                   msg=f"window {window}")


def test_window_must_be_a_positive_int():
    args = paged_batch([20], [1], 4, 2, 64, 16, seed=23)
    for window in (0, -3, 2.5, True, "16"):
        with pytest.raises(ValueError, match="window="): decode(*args[:5], window=window)
        with pytest.raises(ValueError, match="window="): prefill(*args, window=window)
        with pytest.raises(ValueError, match="window="): reference(*args, window=window)


def test_prefill_longest_first_computes_the_same(monkeypatch):
    "PREFILL_LONGEST_FIRST only reorders the programs: each writes its rows as before, bit for bit, windowed too."
    lens, q_lens = [16, 200, 100, 150, 90, 40], [16, 200, 30, 130, 1, 0]  # several query tiles, fewer, one, none
    args = paged_batch(lens, q_lens, 4, 2, 64, 16, seed=24)
    for window in (None, 17):
        monkeypatch.setattr(kernels, "PREFILL_LONGEST_FIRST", False)
        in_order = prefill(*args, window=window)
        monkeypatch.setattr(kernels, "PREFILL_LONGEST_FIRST", True)
        assert torch.equal(prefill(*args, window=window), in_order)
    torch.testing.assert_close(in_order, reference(*args, window=17), **TOL[torch.float32])


def test_prefill_max_seqlen_q_given_or_read():
    args = paged_batch([40, 70], [40, 66], 4, 2, 64, 16, seed=3)
    torch.testing.assert_close(prefill(*args, max_seqlen_q=66), prefill(*args))


def test_prefill_in_chunks_equals_one_prefill():
    "A prompt prefilled in two steps (the second continuing from cached blocks) gives the rows of one prefill."
    S, first, H, K, D, b = 90, 37, 4, 2, 64, 16
    g = torch.Generator().manual_seed(4)
    q = torch.randn(S, H, D, generator=g).to(DEVICE)
    k, v = torch.randn(2, S, K, D, generator=g).to(DEVICE)
    table = torch.randperm(8, generator=g)[:6].int().to(DEVICE)
    pos = torch.arange(S, device=DEVICE)
    slots = table.long()[pos // b] * b + pos % b
    i32 = dict(dtype=torch.int32, device=DEVICE)
    def step(caches, start, end):  # store tokens start:end, then attend their queries over positions 0:end
        store_kv(k[start:end], v[start:end], *caches, slots[start:end])
        return prefill(q[start:end], *caches, table[None], torch.tensor([end], **i32), torch.tensor([0, end - start], **i32))
    new_caches = lambda: tuple(torch.full((8, b, K, D), float("nan"), device=DEVICE) for _ in range(2))
    whole = step(new_caches(), 0, S)
    caches = new_caches()
    chunks = torch.cat([step(caches, 0, first), step(caches, first, S)])
    torch.testing.assert_close(chunks, whole, atol=1e-5, rtol=1e-5)


def test_prefill_with_one_query_equals_decode():
    lens = boundary_lens(16)
    args = paged_batch(lens, [1] * len(lens), 4, 2, 64, 16, seed=5)
    torch.testing.assert_close(prefill(*args), decode(*args[:5], num_splits=3), atol=2e-6, rtol=1e-5)


# ---- through the model's attention seam

@pytest.mark.parametrize("arch,window", [("llama", None), ("mistral", 5)])
def test_triton_seam_matches_reference_seam(arch, window, tmp_path):
    "Two sequences of a tiny model, prefilled together then decoded together, with blocks of 4; Mistral with a window of 5."
    from nanoserve.block_manager import BlockManager
    from nanoserve.loader import load_model
    from nanoserve.testing import save_tiny_model
    model = load_model(save_tiny_model(arch, tmp_path / arch, sliding_window=window) if window else save_tiny_model(arch, tmp_path / arch),
                       dtype=torch.float32, device=DEVICE)
    assert [layer.self_attn.window for layer in model.model.layers] == [window] * model.config.num_hidden_layers
    g = torch.Generator().manual_seed(6)
    seqs = {"a": torch.randint(0, 512, (9,), generator=g), "b": torch.randint(0, 512, (14,), generator=g)}
    logits = {}
    for seam in (PagedAttention, TritonPagedAttention):
        blocks, cache = BlockManager(12, 4), PagedKVCache.from_config(model.config, 12, 4, device=DEVICE)
        rows = []
        for step in ({s: t[:-2] for s, t in seqs.items()}, {s: t[-2:-1] for s, t in seqs.items()}, {s: t[-1:] for s, t in seqs.items()}):
            for s, t in step.items():
                if s in blocks: [blocks.append_slot(s) for _ in t]
                else: blocks.allocate(s, len(t))
            meta = PagedAttentionMetadata.from_block_manager(blocks, list(step), [len(t) for t in step.values()], DEVICE)
            with torch.no_grad():
                rows.append(model(torch.cat(list(step.values())).to(DEVICE), meta.positions(), attention=seam(cache, meta)))
        logits[seam] = torch.cat(rows)
    torch.testing.assert_close(logits[TritonPagedAttention], logits[PagedAttention], atol=1e-5, rtol=1e-5)


# ---- the checks can fail

def test_trap_swapped_block_table_is_caught():
    "The kernel really reads through the block table: swapping two entries of a prefill sequence changes its rows."
    args = paged_batch([40, 33], [40, 1], 4, 2, 64, 16, seed=7)
    q, k_cache, v_cache, bt, lens, cu = args
    swapped = bt.clone()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    err = (prefill(q, k_cache, v_cache, swapped, lens, cu) - reference(*args))[:40].abs().max().item()
    assert err > 0.1


def test_trap_off_by_one_context_is_caught():
    args = paged_batch(boundary_lens(16), [1] * 6, 4, 2, 64, 16, seed=8)
    q, k_cache, v_cache, bt, lens, _ = args
    assert (decode(q, k_cache, v_cache, bt, lens - 1) - reference(*args))[lens > 1].abs().max().item() > 1e-3


@pytest.mark.skipif(torch.cuda.is_available(), reason="a trap of the CPU interpreter")
def test_trap_interpreter_without_upcast_miscomputes_bf16(monkeypatch):
    "Why the kernels upcast under the interpreter: told they run compiled, bf16 results are garbage."
    args = paged_batch([20, 33], [1, 1], 4, 2, 64, 16, torch.bfloat16, seed=9)
    monkeypatch.setattr(kernels, "interpreting", lambda: False)  # UPCAST=False ...
    monkeypatch.setattr(kernels, "_check_devices", lambda **tensors: None)  # ... and no complaint about CPU tensors
    err = (decode(*args[:5], num_splits=1).float() - reference(*args).float()).abs().max().item()
    assert not err < 1  # NaN or far off


# ---- arguments

def test_bad_arguments_raise_value_errors(monkeypatch):
    q, k_cache, v_cache, bt, lens, cu = paged_batch([20, 33], [1, 1], 4, 2, 64, 16, seed=10)
    call = lambda **kw: paged_decode_attention(**{**dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=bt,
                                                         context_lens=lens, scale=0.125), **kw})
    cases = {
        "q is torch.float64": dict(q=q.double()),
        "D=64": dict(q=q[..., :32]),
        "not a multiple": dict(q=q[:, :3]),
        "block_tables must be": dict(block_tables=bt.long()),
        "context_lens must be": dict(context_lens=lens[None]),
        "B=2 sequences": dict(context_lens=lens[:1]),
        "one shape": dict(v_cache=v_cache[:, :8]),
        "power of two": dict(k_cache=k_cache[:, :12], v_cache=v_cache[:, :12]),
        "num_splits=0": dict(num_splits=0),
        "out must match": dict(out=torch.empty(2, 4, 32, device=DEVICE)),
    }
    for message, kwargs in cases.items():
        with pytest.raises(ValueError, match=message):
            call(**kwargs)
    B = 65536  # one more sequence than the decode grid's second dimension holds
    with pytest.raises(ValueError, match="B=65536 sequences"):
        call(q=q[:1].expand(B, -1, -1), block_tables=bt[:1].expand(B, -1), context_lens=lens[:1].repeat(B))
    with pytest.raises(ValueError, match="B=65536 sequences"):
        paged_prefill_attention(q, k_cache, v_cache, bt[:1].expand(B, -1), lens[:1].repeat(B),
                                torch.arange(B + 1, dtype=torch.int32, device=DEVICE).clamp(max=2), 0.125)
    with pytest.raises(ValueError, match="cu_seqlens_q 3"):
        paged_prefill_attention(q, k_cache, v_cache, bt, lens, cu[:2], 0.125)
    with pytest.raises(ValueError, match="slot_mapping has 3 slots for 2 tokens"):
        store_kv(k_cache[0, :2], v_cache[0, :2], k_cache, v_cache, torch.arange(3, device=DEVICE))
    with pytest.raises(ValueError, match="the cache is torch.float32"):
        store_kv(k_cache[0, :2].half(), v_cache[0, :2].half(), k_cache, v_cache, torch.arange(2, device=DEVICE))
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="need CUDA tensors"):
            call()


@pytest.mark.skipif(not interpreting(), reason="values are checked only in the interpreter, where they are on the host")
def test_bad_values_raise_value_errors_in_the_interpreter():
    "In the interpreter a block id outside the pool would read outside it and kill the process; the wrappers refuse it first."
    q, k_cache, v_cache, bt, lens, cu = paged_batch([20, 33], [1, 1], 4, 2, 64, 16, seed=11)
    decode = lambda **kw: paged_decode_attention(**{**dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=bt,
                                                           context_lens=lens, scale=0.125), **kw})
    far = bt.clone(); far[1, 2] = k_cache.shape[0]  # the third block of a 33-token context, one past the pool
    pad = bt.clone(); pad[1, 1] = -1  # padding inside the context
    for message, kwargs in {"block ids a context uses": dict(block_tables=far), "got values from -1": dict(block_tables=pad),
                            "context_lens must be in": dict(context_lens=lens + 64),
                            "scale=tensor": dict(scale=torch.tensor(0.125)), "scale=nan": dict(scale=float("nan"))}.items():
        with pytest.raises(ValueError, match=message):
            decode(**kwargs)
    prefill = lambda **kw: paged_prefill_attention(**{**dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=bt,
                                                             context_lens=lens, cu_seqlens_q=cu, scale=0.125), **kw})
    assert torch.equal(prefill(max_seqlen_q=1), prefill())
    with pytest.raises(ValueError, match="shorter than the longest query"):
        prefill(q=torch.cat([q, q]), cu_seqlens_q=cu * 2, max_seqlen_q=1)
    with pytest.raises(ValueError, match="max_seqlen_q=-3"):
        prefill(max_seqlen_q=-3)
    with pytest.raises(ValueError, match="block ids a context uses"):
        prefill(block_tables=far)
    with pytest.raises(ValueError, match="slot_mapping values must be"):
        store_kv(k_cache[0, :2], v_cache[0, :2], k_cache, v_cache, torch.tensor([0, k_cache.shape[0] * 16]))


def test_choose_num_splits():
    assert choose_num_splits(256, 8, 16384) == 1  # 2048 programs fill an H100 without splitting
    assert choose_num_splits(64, 8, 4096) == 2
    assert choose_num_splits(1, 8, 16384) == kernels.DECODE_MAX_SPLITS
    assert choose_num_splits(1, 8, 512) == 4  # never shorter than DECODE_MIN_SPLIT_TOKENS
    assert choose_num_splits(8, 8, 100) == 1


def test_choose_num_splits_stops_at_one_wave():
    assert choose_num_splits(64, 8, 4096, 132, programs_per_wave=5 * 132) == 1  # 2 splits would be 1.55 waves
    assert choose_num_splits(8, 8, 4096, 132, programs_per_wave=5 * 132) == 9  # 576 programs fit one wave of 660
    assert choose_num_splits(8, 8, 4096, 132, programs_per_wave=3 * 132) == 6  # 9 would not: the most that fit
    assert choose_num_splits(256, 8, 4096, 132, programs_per_wave=3 * 132) == 1  # more than a wave unsplit: never 0
    assert choose_num_splits(1, 8, 512, 132, programs_per_wave=5 * 132) == 4  # the cap never raises a split count


def test_resident_programs():
    # the 128-key tile for heads of 64, compiled for sm_90 (ptxas -v): 96 registers, 39 KiB of shared memory, 4 warps
    assert kernels.resident_programs(96, 39 * 1024, 4) == 5  # registers: 21 warps of 3072 registers, 5 programs of 4
    assert kernels.resident_programs(32, 100 * 1024, 4) == 2  # shared memory: 2 x (100 KiB + 1 KiB) of 228 KiB
    assert kernels.resident_programs(32, 0, 8) == 8  # warps: 64 per SM
    assert kernels.resident_programs(16, 1024, 1) == 32  # at most 32 programs on an SM
    assert kernels.resident_programs(97, 0, 4) == 4  # 97 registers round up to 104 per thread: 19 warps
    assert kernels.resident_programs(255, 300 * 1024, 16) == 1  # never less than one: the launch would fail, not queue


def test_decode_splits_within_one_wave(monkeypatch):
    "decode_num_splits caps choose_num_splits at the wave that _programs_per_wave reports, and the launch follows it."
    lens = [100, 2000, 517, 16, 900]
    args = paged_batch(lens, [1] * len(lens), 8, 2, 64, 16, seed=7)
    q, k_cache, _, block_tables = args[:4]
    uncapped = choose_num_splits(5, 2, block_tables.shape[1] * 16, kernels._num_sms(q.device))
    assert not kernels.DECODE_ONE_WAVE and kernels.decode_num_splits(q, k_cache, block_tables) == uncapped  # off by default
    monkeypatch.setattr(kernels, "DECODE_ONE_WAVE", True)
    assert kernels.decode_num_splits(q, k_cache, block_tables) == uncapped  # the interpreter: no binary, no cap
    monkeypatch.setattr(kernels, "_programs_per_wave", lambda q, k_cache, block_tables, num_splits, window: 5 * 2 * 3)
    assert uncapped > 3 and kernels.decode_num_splits(q, k_cache, block_tables) == 3
    spy = LaunchSpy(kernels._decode_kernel)
    monkeypatch.setattr(kernels, "_decode_kernel", spy)
    torch.testing.assert_close(decode(*args[:5]), reference(*args), **TOL[torch.float32])
    assert [grid for grid, _ in spy.launches] == [(2, 5, 3)]
    monkeypatch.setattr(kernels, "DECODE_ONE_WAVE", False)
    assert kernels.decode_num_splits(q, k_cache, block_tables) == uncapped


def test_decode_tile_follows_the_table():
    assert kernels.decode_tile(256 * 8 / 132, 64) == (128, 4, 3)  # batch 256, 8 KV heads: the last row
    assert kernels.decode_tile(8 * 8 * 9 / 132, 128) == (64, 2, 3)  # batch 8, 9 splits
    assert kernels.decode_tile(8 * 8 * 4 / 132, 128) == (64, 2, 3)  # batch 8, 4 splits: 1.9 programs per SM
    assert kernels.decode_tile(1 * 8 * 16 / 132, 128) == (128, 4, 1)  # batch 1, 16 splits: under one program per SM
    assert kernels.decode_tile(1 * 8 * 16 / 132, 64) == (128, 4, 3)
    assert kernels.decode_tile(1.0, 80) == kernels.decode_tile(1.0, 128)  # a head dim between two columns takes the wider
    assert kernels.decode_tile(0.1, 256) == (64, 4, 1)  # wider than the table: as many bytes per tile, fewer keys
    assert kernels.decode_tile(4.0, 256) == (32, 2, 3)
    # an 8-bit cache: heads of 128 keep 64 keys and 2 warps on large grids; otherwise the tiles of 16 bits
    assert kernels.decode_tile(256 * 8 / 132, 128, kernels.FP8) == (64, 2, 3)
    assert kernels.decode_tile(256 * 8 / 132, 64, kernels.FP8) == (128, 4, 3)
    assert all(kernels.decode_tile(p, d, kernels.FP8) == kernels.decode_tile(p, d) for p in (0.5, 1.0, 3.0, 5.0) for d in (64, 128))
    assert kernels.decode_tile(256 * 8 / 132, 64, torch.bfloat16) == (128, 4, 3)


def test_decode_launches_the_tile_decode_tile_picks(monkeypatch):
    lens = [1, 17, 100, 300, 40]
    args = paged_batch(lens, [1] * len(lens), 8, 2, 64, 16, seed=6)
    asked = []
    monkeypatch.setattr(kernels, "decode_tile", lambda programs_per_sm, head_dim, cache_dtype=None:
                        asked.append((programs_per_sm, head_dim, cache_dtype)) or (32, 2, 3))
    spy = LaunchSpy(kernels._decode_kernel)
    monkeypatch.setattr(kernels, "_decode_kernel", spy)
    out = decode(*args[:5], num_splits=3)
    torch.testing.assert_close(out, reference(*args), **TOL[torch.float32])
    (grid, kw), = spy.launches
    assert asked == [(2 * 5 * 3 / kernels._num_sms(out.device), 64, torch.float32)]  # KV heads x sequences x splits per SM
    assert grid == (2, 5, 3) and (kw["BLOCK_N"], kw["num_warps"], kw["num_stages"]) == (32, 2, 3)


def table_tiles() -> list:
    "Every distinct tile of DECODE_TILES and DECODE_TILES_FP8."
    return sorted({t for table in (kernels.DECODE_TILES, kernels.DECODE_TILES_FP8) for _, by_dim in table for t in by_dim.values()})


def test_decode_every_tile_of_the_table_matches_reference(monkeypatch):
    lens = [1, 15, 16, 17, 100, 129, 300]
    args = paged_batch(lens, [1] * len(lens), 8, 2, 64, 16, seed=5)
    ref = reference(*args)
    for tile in table_tiles():
        monkeypatch.setattr(kernels, "decode_tile", lambda programs_per_sm, head_dim, cache_dtype=None, tile=tile: tile)
        for n in (1, 3):
            torch.testing.assert_close(decode(*args[:5], num_splits=n), ref, **TOL[torch.float32], msg=f"tile {tile} splits {n}")


def test_decode_attention_bytes():
    # Llama-3.2-1B shape, batch 64 x 4096: keys and values dominate, queries and outputs are 0.05 %
    kv = 2 * 64 * 4096 * 8 * 64 * 2
    assert decode_attention_bytes(64, 4096, 32, 8, 64) == kv + 2 * 64 * 32 * 64 * 2


# ---- an 8-bit cache (chapter 9c): stored as torch rounds to float8_e4m3fn, read back in the queries' type

FP8 = kernels.FP8


def fp8_batch(context_lens, q_lens, H, K, D, dtype=torch.float32, seed=0):
    "paged_batch's batch, in the engine's head-major pools, with the cache rounded to 8 bits and the queries in `dtype`."
    q, k_cache, v_cache, *rest = paged_batch(context_lens, q_lens, H, K, D, 16, torch.float32, seed, head_major=True)
    return (q.to(dtype), k_cache.to(FP8), v_cache.to(FP8), *rest)  # NaN stays NaN: unwritten slots stay poisoned


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_store_kv_into_an_8_bit_cache_rounds_as_torch_does(dtype):
    "Bit for bit torch's .to(float8_e4m3fn): to nearest, and past 448 (its largest value) saturated, not NaN."
    g = torch.Generator().manual_seed(3)
    T, K, D = 37, 2, 64
    k, v = ((torch.randn(T, K, D, generator=g) * 40).to(dtype).to(DEVICE) for _ in range(2))  # some past 448
    k[0, 0, :6] = torch.tensor([1e4, -1e4, 448.0, -7.84, float("nan"), float("inf")]).to(dtype)
    slots = torch.randperm(8 * 16, generator=g)[:T].to(DEVICE)
    slots[[3, 30]] = -1
    pools = [[torch.full((8, 16, K, D), float("nan"), device=DEVICE).to(FP8) for _ in range(2)] for _ in range(2)]
    store_kv(k, v, *pools[0], slots)
    store_kv_ref(k, v, *pools[1], slots)
    for ours, ref in zip(*pools):
        nan = ref.float().isnan()  # unwritten slots, and the NaN key: NaN in both (the sign of a NaN aside)
        assert torch.equal(ours.float().isnan(), nan) and torch.equal(ours.view(torch.uint8)[~nan], ref.view(torch.uint8)[~nan])
    written = pools[0][0][slots[0] // 16, slots[0] % 16, 0, :6].float().tolist()
    assert written[:4] == [448.0, -448.0, 448.0, -8.0] and written[4] != written[4] and written[5] == 448.0


@pytest.mark.parametrize("G, D", [(4, 64), (2, 128), (1, 32)])
def test_kernels_over_an_8_bit_cache_match_the_reference(G, D):
    "Decode, split or not, and prefill read the 8-bit values the reference reads, and attend with them in float32."
    K, lens = 2, [1, 16, 17, 40, 100]
    dec = fp8_batch(lens, [1] * len(lens), G * K, K, D, seed=4)
    ref = reference(*dec)
    for n in (None, 1, 3): torch.testing.assert_close(decode(*dec[:5], num_splits=n), ref, **TOL[torch.float32])
    pre = fp8_batch(lens, [1, 5, 17, 3, 40], G * K, K, D, seed=5)
    torch.testing.assert_close(prefill(*pre), reference(*pre), **TOL[torch.float32])


def test_an_8_bit_cache_takes_queries_of_16_or_32_bits_and_a_pair_of_one_dtype():
    q, k_cache, v_cache, bt, lens, _ = fp8_batch([5, 9], [1, 1], 4, 2, 32)
    with pytest.raises(ValueError, match="8-bit cache takes queries of 16 or 32 bits"): decode(q.to(FP8), k_cache, v_cache, bt, lens)
    with pytest.raises(ValueError, match="share one dtype"): decode(q, k_cache, v_cache.float(), bt, lens)
    slot = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for k, v in ((torch.zeros(1, 2, 32, dtype=torch.int8), torch.zeros(1, 2, 32, dtype=torch.int8)), (torch.zeros(1, 2, 32), torch.zeros(1, 2, 32).half())):
        with pytest.raises(ValueError, match="but the cache is"): store_kv(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slot)


# ---- GPU: compiled, bf16/fp16, real model shapes

SHAPES = {"llama-3.2-1b": (32, 8, 64), "qwen3-0.6b": (16, 8, 128)}  # H, K, D


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_decode_real_shapes(shape, dtype):
    H, K, D = SHAPES[shape]
    lens = [1, 15, 16, 17, 511, 512, 513, 1000, 2047, 4096, 4097, 3000, 77, 129, 2500, 8191]
    args = paged_batch(lens, [1] * len(lens), H, K, D, 16, dtype, seed=11)
    ref = reference(*args)
    for n in (None, 1, 8):
        torch.testing.assert_close(decode(*args[:5], num_splits=n), ref, **TOL[dtype])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_one_wave_reads_the_compiled_kernel(shape, monkeypatch):
    "On a GPU the wave comes from the compiled kernel's registers and shared memory, and the capped output equals the uncapped."
    H, K, D = SHAPES[shape]
    lens = [4096] * 64  # 2 splits by DECODE_PROGRAMS_PER_SM: more than one wave of the 128-key tile on an H100
    args = paged_batch(lens, [1] * len(lens), H, K, D, 16, torch.bfloat16, seed=13)
    q, k_cache, _, block_tables = args[:4]
    sms = kernels._num_sms(q.device)
    monkeypatch.setattr(kernels, "DECODE_ONE_WAVE", True)
    wave = kernels._programs_per_wave(q, k_cache, block_tables, 2, None)
    assert sms <= wave <= 32 * sms and wave % sms == 0
    assert kernels.decode_num_splits(q, k_cache, block_tables) == choose_num_splits(64, K, 4096, sms, programs_per_wave=wave)
    capped = decode(*args[:5])
    monkeypatch.setattr(kernels, "DECODE_ONE_WAVE", False)
    uncapped = decode(*args[:5])
    torch.testing.assert_close(capped, reference(*args), **TOL[torch.bfloat16])
    torch.testing.assert_close(capped, uncapped, **TOL[torch.bfloat16])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("eight_bit", [False, True])
def test_gpu_decode_every_tile_of_the_table(shape, eight_bit, monkeypatch):
    "Each tile of DECODE_TILES and DECODE_TILES_FP8, split or not, over a bf16 cache and over an 8-bit one (chapter 9c)."
    H, K, D = SHAPES[shape]
    lens = [1, 16, 17, 511, 513, 4097, 77, 2500]
    args = (fp8_batch(lens, [1] * len(lens), H, K, D, torch.bfloat16, seed=14) if eight_bit
            else paged_batch(lens, [1] * len(lens), H, K, D, 16, torch.bfloat16, seed=12))
    ref = reference(*args)
    for tile in table_tiles():
        monkeypatch.setattr(kernels, "decode_tile", lambda programs_per_sm, head_dim, cache_dtype=None, tile=tile: tile)
        for n in (1, 5):
            torch.testing.assert_close(decode(*args[:5], num_splits=n), ref, **TOL[torch.bfloat16], msg=f"tile {tile} splits {n}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_prefill_real_shapes(shape, block_size):
    H, K, D = SHAPES[shape]
    lens, q_lens = [1000, 1000, 2000, 129, 64, 700], [1000, 700, 1, 129, 64, 3]
    args = paged_batch(lens, q_lens, H, K, D, block_size, torch.bfloat16, seed=12)
    torch.testing.assert_close(prefill(*args), reference(*args), **TOL[torch.bfloat16])
    outs = {}
    for longest_first in (False, True):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(kernels, "PREFILL_LONGEST_FIRST", longest_first)
            outs[longest_first] = prefill(*args)
    assert torch.equal(outs[False], outs[True])  # only the order in which the programs start differs


def test_offsets_pass_int32_at_the_last_element():
    "Whether the largest element offset, sum((size - 1) * stride), reaches 2**31 (meta tensors: strides without storage)."
    view = lambda shape, strides: torch.empty(0, device="meta").as_strided(shape, strides)
    assert not kernels.offsets_pass_int32(torch.empty(0), torch.zeros(5, 3))
    assert not kernels.offsets_pass_int32(view((2, 64, 128), (2**31 - 8192, 128, 1)))  # last element at 2**31 - 1
    assert kernels.offsets_pass_int32(torch.zeros(2), view((2, 64, 128), (2**31 - 8191, 128, 1)))  # ... at 2**31
    assert not kernels.offsets_pass_int32(view((2**40, 8), (0, 1)))  # a broadcast row repeats: offsets stay small


def test_prefill_with_64_bit_rows_equals_32_bit_rows(monkeypatch):
    "WIDE_ROWS, which the wrapper asks offsets_pass_int32 for with q and out, computes the same attention as 32-bit offsets."
    args = paged_batch([40, 3, 17], [40, 1, 5], 4, 2, 16, 8, seed=18)
    narrow = prefill(*args)
    asked = []
    monkeypatch.setattr(kernels, "offsets_pass_int32", lambda *tensors: asked.append(tensors) or True)
    wide = prefill(*args)
    assert torch.equal(wide, narrow)
    assert len(asked) == 1 and asked[0][0] is args[0] and asked[0][1] is wide  # q, and the output it returned


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("wide", ["q and out rows", "out rows", "q heads"])
def test_gpu_prefill_offsets_past_two_to_the_31_elements(wide):
    """Offsets of q or out past 2**31, as a step of 256k rows of 64 heads x 128 would have: WIDE_ROWS makes every row's and
    head's offset 64-bit. Views 2**29 elements apart (a row, or a head) in buffers of 4.3-7.5 GB, against compact copies."""
    q, k_cache, v_cache, tables, lens, cu = paged_batch([5, 1, 70], [1, 1, 3], 8, 2, 64, 16, torch.bfloat16, seed=17)
    T, H, D = q.shape  # rows 2**29 apart: row 4 starts at 2**31; heads 2**29 apart: head 7 at 3.5 * 2**30
    rows_apart = lambda: torch.empty(2**29 * (T - 1) + H * D, dtype=torch.bfloat16, device="cuda").as_strided((T, H, D), (2**29, D, 1))
    heads_apart = lambda: torch.empty(2**29 * (H - 1) + T * D, dtype=torch.bfloat16, device="cuda").as_strided((T, H, D), (D, 2**29, 1))
    q_wide = {"q and out rows": rows_apart, "out rows": lambda: q.clone(), "q heads": heads_apart}[wide]()
    out_wide = rows_apart() if wide != "q heads" else torch.empty_like(q)
    q_wide.copy_(q)
    out_wide.fill_(float("nan"))
    got = paged_prefill_attention(q_wide, k_cache, v_cache, tables, lens, cu, D**-0.5, out=out_wide)
    assert torch.equal(got.clone(), prefill(q, k_cache, v_cache, tables, lens, cu))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_sliding_windows_real_shapes(shape):
    H, K, D = SHAPES[shape]
    lens, q_lens = [1, 17, 511, 513, 4097, 77, 2500, 1000, 2000], [1, 17, 1, 1, 1, 77, 1, 700, 64]
    decode_args = paged_batch(lens, [1] * len(lens), H, K, D, 16, torch.bfloat16, seed=13)
    prefill_args = paged_batch(lens, q_lens, H, K, D, 16, torch.bfloat16, seed=14)
    for window in (1, 16, 100, 4096):  # 4096: Mistral 7B v0.1's
        ref = reference(*decode_args, window=window)
        for n in (None, 1, 8):
            torch.testing.assert_close(decode(*decode_args[:5], num_splits=n, window=window), ref, **TOL[torch.bfloat16],
                                       msg=f"decode, window {window}, splits {n}")
        torch.testing.assert_close(prefill(*prefill_args, window=window), reference(*prefill_args, window=window),
                                   **TOL[torch.bfloat16], msg=f"prefill, window {window}")


@pytest.mark.gpu
@needs_gpu
def test_gpu_blocks_of_256_with_heads_of_256():
    "A large block and a wide head in bf16: the tiles stay within shared memory (they used to grow to the block)."
    lens, q_lens = [1, 300, 700, 256], [1, 300, 50, 1]
    pre = paged_batch(lens, q_lens, 8, 2, 256, 256, torch.bfloat16, seed=15, head_major=True)
    torch.testing.assert_close(prefill(*pre), reference(*pre), **TOL[torch.bfloat16])
    dec = paged_batch(lens, [1] * len(lens), 8, 2, 256, 256, torch.bfloat16, seed=16, head_major=True)
    for n in (None, 1, 4):
        torch.testing.assert_close(decode(*dec[:5], num_splits=n), reference(*dec), **TOL[torch.bfloat16])


@pytest.mark.gpu
@needs_gpu
def test_gpu_store_kv_many_tokens():
    g = torch.Generator().manual_seed(13)
    T, K, D, b = 5000, 8, 128, 16
    k, v = torch.randn(2, T, K, D, generator=g).bfloat16().cuda()
    slots = torch.randperm(400 * b, generator=g)[:T].cuda()
    slots[::97] = -1
    ours = [torch.zeros(400, b, K, D, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    ref = [c.clone() for c in ours]
    store_kv(k, v, *ours, slots)
    store_kv_ref(k, v, *ref, slots)
    assert all(torch.equal(a, r) for a, r in zip(ours, ref))


@pytest.mark.gpu
@needs_gpu
def test_gpu_decode_in_a_cuda_graph():
    "Decode replays in a CUDA graph (chapter 11): no host synchronisation, partials from the graph's pool."
    H, K, D = SHAPES["llama-3.2-1b"]
    lens = [100, 2000, 517, 16]
    q, k_cache, v_cache, bt, ctx, cu = paged_batch(lens, [1] * 4, H, K, D, 16, torch.bfloat16, seed=14)
    out = torch.empty_like(q)
    paged_decode_attention(q, k_cache, v_cache, bt, ctx, D**-0.5, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k_cache, v_cache, bt, ctx, D**-0.5, out=out)
    q.copy_(torch.randn_like(q))
    ctx.copy_(torch.tensor([99, 1999, 517, 9], dtype=torch.int32))
    graph.replay()
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, bt, ctx, cu), **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper or newer GPU")
def test_gpu_kernels_launched_early_equal_plain_ones_eagerly_and_in_a_graph(check_early_launches):
    "store_kv, decode and its split reduction launched early (PDL), each step's keys made from the last step's output: bit-equal."
    H, K, D = SHAPES["llama-3.2-1b"]
    lens = [100, 2000, 517, 16]
    q0, k_cache, v_cache, bt, ctx, _ = paged_batch(lens, [1] * 4, H, K, D, 16, torch.bfloat16, seed=15)
    last = torch.tensor(lens) - 1  # each sequence's new token is its last position
    slots = (bt.cpu()[torch.arange(4), last // 16] * 16 + last % 16).cuda()

    def chain(kept=None):  # with PDL each kernel lets the next one start early, and reads only after the one before has finished
        kc, vc, q, outs = k_cache.clone(), v_cache.clone(), q0, []
        for _ in range(16):
            store_kv(q[:, :K], q[:, K:2 * K], kc, vc, slots)  # the new token's key and value come from the last output
            q = paged_decode_attention(q, kc, vc, bt, ctx, D ** -0.5, num_splits=8)
            outs.append(q)
        if kept is not None: kept += outs + [kc, vc]
        return torch.cat(outs)

    check_early_launches(chain, kernels)


def benchmark_script(name: str):
    "benchmarks/<name>.py imported as a module."
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent.parent / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not interpreting(), reason="the check runs in the interpreter, in float32")
def test_decode_designs_not_adopted_still_match_the_kernel():
    "benchmarks/decode_alternatives.py (stream-K, interleaved splits, TMA) computes what paged_decode_attention does, so its timings compare like with like."
    worst = benchmark_script("decode_alternatives").cpu_check()
    assert max(worst.values()) < 1e-4, worst


@pytest.mark.skipif(not interpreting(), reason="the check runs in the interpreter, in float32")
def test_the_evict_first_variant_differs_from_the_kernel_only_in_its_hint():
    "benchmarks/decode_cache_hints.py times the library's own source with evict_first on the two cache loads; it computes the same."
    import inspect
    from pathlib import Path
    variant = benchmark_script("decode_cache_hints").evict_first_kernels()
    source = Path(variant.__file__).read_text()
    assert source.count('eviction_policy="evict_first"') == 2 and "eviction_policy" in inspect.getsource(variant._load_kv_tile.fn)
    assert source.replace(', eviction_policy="evict_first"', "").replace("from nanoserve.", "from .") == \
        Path(kernels.__file__).read_text()
    q, k_cache, v_cache, bt, ctx, _ = paged_batch([1, 15, 16, 17, 40], [1] * 5, 8, 2, 64, 16, torch.float32, seed=16)
    for splits in (None, 1, 3):
        torch.testing.assert_close(variant.paged_decode_attention(q, k_cache, v_cache, bt, ctx, 0.125, num_splits=splits),
                                   paged_decode_attention(q, k_cache, v_cache, bt, ctx, 0.125, num_splits=splits), rtol=0, atol=0)


def test_a_block_table_addressed_tile_gets_a_buffer_for_every_two_pipeline_stages():
    """What chapter 13 says of num_stages: Triton's pipeliner gives the decode kernel's gathered tiles (num_stages - 1) // 2
    buffers (sm_90), and with one buffer a program's copies wait for its products (section 12)."""
    import json, os, subprocess, sys
    from pathlib import Path
    script = Path(__file__).parent.parent / "benchmarks" / "decode_alternatives.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for the GPU, no GPU needed
    done = subprocess.run([sys.executable, str(script), "--buffers"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout)
    buffers, schedules = found["num_stages -> key buffers"], found["num_stages -> loop schedule"]
    assert buffers == {str(s): 0 if s == 1 else max(1, (s - 1) // 2) for s in range(1, 10)}, buffers
    # chapter 13, section 12: with one buffer the loop waits for every copy before its products and issues the next
    # tile's copies after them, so a program's loads never overlap its own arithmetic; each further buffer leaves one
    # more tile's copies (keys, values, block ids) in flight
    assert schedules["1"] == ["dot", "dot"], schedules
    for s in range(2, 10):
        wait, *rest = schedules[str(s)]
        copies = ["copy"] * (2 if s == 2 else 3)  # keys and values, and from 3 stages the next block ids too
        assert wait == f"wait {3 * (buffers[str(s)] - 1)}" and rest == ["dot", "dot", *copies], schedules


def test_the_warp_specialised_gluon_kernel_compiles_for_hopper():
    """benchmarks/decode_gluon.py (chapter 13, section 11) still compiles for sm_90 with this Triton, into what the chapter says:
    TMA copies of 16 positions (BLOCK_N / 16 boxes each for keys and values; a head of 128 bf16, wider than the 128-byte
    swizzle, goes as two copies), tensor-core products unless only loading, and registers handed from the load warp's group to
    the attention warps."""
    import json, os, subprocess, sys
    from pathlib import Path
    script = Path(__file__).parent.parent / "benchmarks" / "decode_gluon.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for the GPU, no GPU needed
    done = subprocess.run([sys.executable, str(script), "--compile"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    variants = json.loads(done.stdout)["sm_90"]
    assert len(variants) == 11
    for name, v in variants.items():
        head_dim, block_n = int(name.split(" ")[0][2:]), int(name.split(" n")[1].split("s")[0])
        assert v["tma_copies"] == 2 * block_n // 16 * head_dim // 64 and (v["mma_sync"] == 0) == name.endswith("bound"), (name, v)
        assert 24 in v["setmaxnreg"] and max(v["setmaxnreg"]) > 40, (name, v)  # the load warp's group gives registers up


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_an_8_bit_cache_at_real_shapes(shape):
    "bf16 queries over a float8_e4m3fn cache: decode split or not, and prefill, against the reference's float32 attention."
    H, K, D = SHAPES[shape]
    lens = [1, 15, 16, 17, 511, 512, 513, 1000, 2047, 4096, 4097, 3000, 77, 129, 2500, 8191]
    dec = fp8_batch(lens, [1] * len(lens), H, K, D, torch.bfloat16, seed=12)
    ref = reference(*dec)
    for n in (None, 1, 8): torch.testing.assert_close(decode(*dec[:5], num_splits=n), ref, **TOL[torch.bfloat16])
    pre = fp8_batch(lens[:6], [1, 15, 16, 17, 300, 512], H, K, D, torch.bfloat16, seed=13)
    torch.testing.assert_close(prefill(*pre), reference(*pre), **TOL[torch.bfloat16])


def test_the_decode_profile_gives_each_kernel_to_the_design_that_launched_it(monkeypatch):
    """benchmarks/decode_profile.py (chapter 13, section 12) cuts Nsight Compute's list of kernels at the spin kernels it
    launches between designs, and refuses a profile whose markers do not match the designs it ran."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    from decode_profile import by_design
    kernel = lambda name: {"Kernel Name": name}
    profiled = [kernel("at::cuda::(anonymous namespace)::spin_kernel(long)"), kernel("cudnn_generated_fort_native_sdpa"),
                kernel("void cudnn::lean_reduction_kernel"), kernel("at::cuda::(anonymous namespace)::spin_kernel(long)"),
                kernel("_decode_kernel"), kernel("_decode_reduce_kernel")]
    order = [{"shape": "Llama-3.2-1B:8:4096", "design": "sdpa_cudnn"}, {"shape": "Llama-3.2-1B:8:4096", "design": "ours"}]
    got = by_design(profiled, order)
    assert [(d["design"], [k["Kernel Name"] for k in d["kernels"]]) for d in got] == [
        ("sdpa_cudnn", ["cudnn_generated_fort_native_sdpa", "void cudnn::lean_reduction_kernel"]),
        ("ours", ["_decode_kernel", "_decode_reduce_kernel"])]
    with pytest.raises(RuntimeError, match="2 markers in the profile for 1 designs"):
        by_design(profiled, order[:1])
