"""Decode-attention designs measured against nanoserve.kernels.paged_decode_attention and SDPA, and not adopted.

Issue 4 asks the paged decode kernel never to be slower than torch's scaled_dot_product_attention on contiguous K/V at
batch >= 8. After the tiles, grid order and head-major blocks of chapters 9 and 13, three gaps remain: batch 8 x
context 512 (a fixed ~1 us per call), batch 64 (the 2-way split) and, by 1-2 %, batch 256. This script holds the
designs that were tried against them, so that each result in benchmarks/results/performance/decode_alternatives_h100.json
can be reproduced (it was measured at commit 3c03a90; since then these kernels end with the library's
_store_decode_result, the same stores moved into a shared function):

  stream-K     a fixed grid of programs (SMs x programs per SM) divides the flat list of tiles (sequence, KV head,
               BLOCK_N keys) into equal ranges; an item (sequence, KV head) finished inside one program is written as
               output, an item cut by a range boundary leaves partial (acc, max, sum) that a fix-up kernel merges. No
               tail, no split heuristic, one loop that never drains its pipeline between items.
  interleaved  split s reads tiles s, s + splits, s + 2 splits, ... so its first tile does not depend on the context
               length; "peeled" also loads that first tile's block ids beside the length instead of after it.
  blocks       the library kernel on blocks of 16..256 tokens, each table random (as the engine's) or in order (a
               sequence's blocks contiguous): how much of the gap is the scatter.
  deep         the library kernel at batch 8 with every tile of a split in flight at once (more pipeline stages).
               Triton gives a load whose addresses come from another load (the block table) (num_stages - 1) // 2
               buffers, so 5 stages hold two tiles, 9 hold four.
  wide         the library kernel with tiles of 256 keys for heads of 64, as many bytes per tile as 128 keys of 128
               (the Qwen3-0.6B shape, whose 128-key tiles reach SDPA's bandwidth where the Llama shape's do not), and
               other tiles, at split counts around the heuristic's (more programs per wave at batch 8, whole waves at 64).
  fill         pipelines as deep as shared memory allows at the grid's residency: at batch 64 with one split, 512
               programs need 4 an SM, which leaves ~56 KB each, three 64-key tiles of a head of 64 (7 stages) instead
               of one 128-key tile; at batch 8, the same at split counts whose programs fit one wave.
  TMA          keys and values copied by the Hopper tensor-memory accelerator: a host tensor descriptor over the
               head-major pool seen as (blocks * K * block_size, D) rows, one (block_size, D) box per block and head,
               so no thread computes a gather address; BLOCKS_PER_TILE boxes per iteration.
  bound        not attention, times only (chapter 13, section 11): the library kernel's grid, splits, tiles, gather and
               merge with no softmax (the two products stay, the scores cast straight to the values' type) and with
               nothing but the loads (each tile summed); and the library kernel with every position reading block 0.
               That last one is no compute bound: every program reads the same lines, and at batch 256 it was slower
               than reading the whole pool.

Times are the median of triton.testing.do_bench over CUDA-graph replays with L2 flushed, as paged_attention.py.

    python benchmarks/decode_alternatives.py --out decode_alternatives.json        # ~4 min on an H100
    python benchmarks/decode_alternatives.py --designs TMA deep                     # some designs only
    python benchmarks/decode_alternatives.py --buffers      # num_stages -> buffers Triton gives a tile, and the loop's
                                                            # schedule of waits, copies and products (no GPU needed)
    TRITON_INTERPRET=1 python benchmarks/decode_alternatives.py --cpu-check        # the kernels against the library's

Progress goes to stderr; stdout gets only the JSON.
"""
import argparse, itertools, json, math, re, sys, time
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
try:
    import nanoserve  # noqa: F401
except ImportError:  # not installed: run from the checkout
    sys.path.insert(0, str(ROOT))
import nanoserve.kernels as kernels
from nanoserve.kernels import (_decode_reduce_kernel, _dot_precision, _follow_early, _load_kv_tile, _online_softmax_step, _pdl,
                               _store_decode_result, interpreting, paged_decode_attention)

# ---- the online-softmax step, safe for a tile with no valid key (an empty context or an empty split)


@triton.jit
def _guarded_step(q, k, v, valid, acc, m_i, l_i, qk_scale, PRECISION: tl.constexpr):
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: weights 0, not NaN
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


# ---- stream-K


@triton.jit
def _flat_layout(lens_ptr, B, K: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr):
    "Each sequence's tiles (at least one), the flat index where each sequence's tiles end (all K heads), the total."
    offs_b = tl.arange(0, BLOCK_B)
    lens = tl.load(lens_ptr + offs_b, mask=offs_b < B, other=0)
    ntiles = tl.where(offs_b < B, tl.maximum((lens + BLOCK_N - 1) // BLOCK_N, 1), 0)
    return offs_b, ntiles, tl.cumsum(ntiles, 0) * K, tl.sum(ntiles, 0) * K


@triton.jit(do_not_specialize=["B", "stride_bt"])
def _stream_k_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, lens_ptr, out_ptr, part_out_ptr, part_m_ptr, part_l_ptr,
                     qk_scale, B, stride_qb, stride_qh, stride_ob, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
                     K: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_B: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                     PRECISION: tl.constexpr, PDL: tl.constexpr):
    _follow_early(PDL)
    p, P = tl.program_id(0).to(tl.int64), tl.num_programs(0)
    offs_b, ntiles, ends, T = _flat_layout(lens_ptr, B, K, BLOCK_B, BLOCK_N)
    lo, hi = (p * T // P).to(tl.int32), ((p + 1) * T // P).to(tl.int32)  # this program's flat tiles
    b = tl.sum((ends <= lo).to(tl.int32), 0)  # where tile lo lies: sequence b, KV head kh, tile j of that item
    n_b = tl.sum(tl.where(offs_b == b, ntiles, 0), 0)
    S = tl.load(lens_ptr + b, mask=b < B, other=0)
    off = lo - tl.sum(tl.where(offs_b < b, ntiles, 0), 0) * K
    kh = off // tl.maximum(n_b, 1)
    j = off - kh * n_b
    seg_j0 = j  # the item's tile where this program's piece of it began
    offs_g, offs_d, offs_n = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
    g_mask, d_mask = offs_g < G, offs_d < D
    gd_mask = g_mask[:, None] & d_mask[None, :]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    for t in range(lo, hi):
        heads = kh * G + offs_g
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gd_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        n = j * BLOCK_N + offs_n
        n_mask = n < S
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_ptr + b * stride_bt, n, n_mask, kh * stride_ch,
                             offs_d, d_mask, stride_cb, stride_cs, BLOCK_SIZE, UPCAST)
        acc, m_i, l_i = _guarded_step(q, k, v, n_mask[None, :], acc, m_i, l_i, qk_scale, PRECISION)
        item_done = j == n_b - 1
        if item_done or t == hi - 1:
            if item_done and seg_j0 == 0:  # the whole item ran here: its output
                o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
                tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                         o.to(out_ptr.dtype.element_ty), mask=gd_mask)
            else:  # a piece: slot 0 if it began at lo, slot 1 if it ends the range
                slot = (p * 2 + (t - j + seg_j0 != lo).to(tl.int64)) * G + offs_g
                tl.store(part_m_ptr + slot, m_i, mask=g_mask)
                tl.store(part_l_ptr + slot, l_i, mask=g_mask)
                tl.store(part_out_ptr + slot[:, None] * D + offs_d[None, :], acc, mask=gd_mask)
            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.full([BLOCK_G], 0.0, tl.float32)
            acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
            seg_j0 = 0
        kh_next = tl.where(item_done, kh + 1, kh)
        seq_done = kh_next == K
        j = tl.where(item_done, 0, j + 1)
        kh = tl.where(seq_done, 0, kh_next)
        b = tl.where(seq_done, b + 1, b)
        # the next item's tile count from registers: read from lens in the loop, Triton's pipeliner (3.6, 3.9) fails
        n_b = tl.sum(tl.where(offs_b == b, ntiles, 0), 0)
        S = tl.load(lens_ptr + b, mask=seq_done & (b < B), other=S)


@triton.jit(do_not_specialize=["B", "P"])
def _stream_k_fixup_kernel(lens_ptr, out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, B, P, stride_ob, stride_oh,
                           K: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
                           PDL: tl.constexpr):
    _follow_early(PDL)
    kh, b = tl.program_id(0), tl.program_id(1)
    offs_b, ntiles, ends, T = _flat_layout(lens_ptr, B, K, BLOCK_B, BLOCK_N)
    n_b = tl.sum(tl.where(offs_b == b, ntiles, 0), 0)
    first = (tl.sum(tl.where(offs_b < b, ntiles, 0), 0) * K + kh * n_b).to(tl.int64)  # the item's flat tiles
    T64 = T.to(tl.int64)
    p_first = ((first + 1) * P + T64 - 1) // T64 - 1  # the program whose range [p T // P, (p + 1) T // P) holds a tile
    p_last = ((first + n_b) * P + T64 - 1) // T64 - 1
    if p_first != p_last:  # cut by a range boundary: merge the pieces
        offs_g, offs_d, offs_p = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_P)
        g_mask, d_mask = offs_g < G, offs_d < D
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.full([BLOCK_G], 0.0, tl.float32)
        acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
        first_slot = (p_first * T64 // P != first).to(tl.int64)  # the item ends p_first's range: its slot 1
        for p0 in range(p_first, p_last + 1, BLOCK_P):
            pp = p0 + offs_p
            p_mask = (pp <= p_last) & ((pp + 1) * T64 // P > pp * T64 // P)  # a program with an empty range wrote nothing
            slot = (pp * 2 + tl.where(pp == p_first, first_slot, 0))[:, None] * G + offs_g[None, :]  # (P, G)
            pm_mask = p_mask[:, None] & g_mask[None, :]
            mp = tl.load(part_m_ptr + slot, mask=pm_mask, other=float("-inf"))
            lp = tl.load(part_l_ptr + slot, mask=pm_mask, other=0.0)
            ap = tl.load(part_out_ptr + slot[:, :, None] * D + offs_d[None, None, :],
                         mask=pm_mask[:, :, None] & d_mask[None, None, :], other=0.0)  # (P, G, D)
            m_new = tl.maximum(m, tl.max(mp, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            w = tl.exp2(mp - m_use[None, :])
            alpha = tl.exp2(m - m_use)
            l = l * alpha + tl.sum(w * lp, 0)
            acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * ap, 0)
            m = m_new
        o = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        heads = kh * G + offs_g
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & d_mask[None, :])


def stream_k_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out=None, tile=(64, 4, 3), programs=None):
    "Decode attention by stream-K: `programs` programs (default 2 per SM) over equal ranges of the flat tiles."
    B, H, D = q.shape
    _, block_size, K, _ = k_cache.shape
    G, (block_n, num_warps, num_stages) = H // K, tile
    out = torch.empty_like(q) if out is None else out
    programs = programs or 2 * kernels._num_sms(q.device)
    part_out = torch.empty(programs, 2, G, D, dtype=torch.float32, device=q.device)
    part_m = torch.empty(programs, 2, G, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    pdl, BLOCK_B, BLOCK_D = _pdl(q.device), max(16, triton.next_power_of_2(B)), triton.next_power_of_2(D)
    _stream_k_kernel[(programs,)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_m, part_l,
        scale * math.log2(math.e), B, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        K=K, G=G, D=D, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_D=BLOCK_D, BLOCK_B=BLOCK_B,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, UPCAST=interpreting(), PRECISION=_dot_precision(q.dtype), PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl)
    _stream_k_fixup_kernel[(K, B)](context_lens, out, part_out, part_m, part_l, B, programs, out.stride(0), out.stride(1),
                                   K=K, G=G, D=D, BLOCK_G=triton.next_power_of_2(G), BLOCK_D=BLOCK_D, BLOCK_B=BLOCK_B,
                                   BLOCK_N=block_n, BLOCK_P=16, PDL=pdl, launch_pdl=pdl)
    return out


# ---- chapter 9's partial results and merge, for the designs that keep its splits


def split_partials(B, H, num_splits, D, device):
    "Each split's unnormalised output (B, H, splits, D), running max and sum (B, H, splits), as chapter 9's kernel writes them."
    part_m = torch.empty(B, H, num_splits, dtype=torch.float32, device=device)
    return torch.empty(B, H, num_splits, D, dtype=torch.float32, device=device), part_m, torch.empty_like(part_m)


def merge_splits(out, part_out, part_m, part_l, num_splits, pdl):
    "Chapter 9's reduction kernel over the splits (nothing to do for one): out (B, H, D)."
    if num_splits > 1:
        B, H, D = out.shape
        _decode_reduce_kernel[(B, H)](out, part_out, part_m, part_l, out.stride(0), out.stride(1), num_splits,
                                      H=H, D=D, BLOCK_S=triton.next_power_of_2(num_splits),
                                      BLOCK_D=triton.next_power_of_2(D), PDL=pdl, launch_pdl=pdl)
    return out


# ---- interleaved splits, first tile peeled


@triton.jit(do_not_specialize=["stride_bt", "num_splits", "table_len"])
def _interleaved_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, lens_ptr, out_ptr, part_out_ptr, part_m_ptr,
                        part_l_ptr, qk_scale, stride_qb, stride_qh, stride_ob, stride_oh, stride_cb, stride_cs,
                        stride_ch, stride_bt, num_splits, table_len,
                        H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
                        PRECISION: tl.constexpr, PEEL: tl.constexpr, PDL: tl.constexpr):
    _follow_early(PDL)
    kh, b, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    S = tl.load(lens_ptr + b)
    offs_g, offs_d, offs_n = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
    heads = kh * G + offs_g
    g_mask, d_mask = offs_g < G, offs_d < D
    gd_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gd_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    bt_row = bt_ptr + b * stride_bt
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    first = split * BLOCK_N
    if PEEL:  # the first tile's block ids are masked by the table's length, so they load beside S, not after it
        n = first + offs_n
        block = tl.load(bt_row + n // BLOCK_SIZE, mask=n < table_len, other=0).to(tl.int64)
        n_mask = n < S
        rows = block * stride_cb + (n % BLOCK_SIZE) * stride_cs + kh * stride_ch
        mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        acc, m_i, l_i = _guarded_step(q, k, v, n_mask[None, :], acc, m_i, l_i, qk_scale, PRECISION)
        first += num_splits * BLOCK_N
    for n0 in range(first, S, num_splits * BLOCK_N):
        n = n0 + offs_n
        n_mask = n < S
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, n, n_mask, kh * stride_ch,
                             offs_d, d_mask, stride_cb, stride_cs, BLOCK_SIZE, UPCAST)
        acc, m_i, l_i = _guarded_step(q, k, v, n_mask[None, :], acc, m_i, l_i, qk_scale, PRECISION)
    _store_decode_result(out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, acc, m_i, l_i, b, heads, split, num_splits,
                         stride_ob, stride_oh, offs_d, g_mask, gd_mask, H, D, SPLIT)


def interleaved_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out=None, peel=True, num_splits=None,
                       tile=None):
    "Decode attention with the library's splits and tiles (or these), but split s reading tiles s, s + splits, ... (chapter 9's merge)."
    _, block_size, K, D = k_cache.shape
    B, H, _ = q.shape
    out = torch.empty_like(q) if out is None else out
    sms = kernels._num_sms(q.device)
    num_splits = num_splits or kernels.choose_num_splits(B, K, block_tables.shape[1] * block_size, sms)
    block_n, num_warps, num_stages = tile or kernels.decode_tile(K * B * num_splits / sms, D)
    pdl, BLOCK_D = _pdl(q.device), triton.next_power_of_2(D)
    part_out, part_m, part_l = split_partials(B, H, num_splits, D, q.device)
    _interleaved_kernel[(K, B, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_m, part_l,
        scale * math.log2(math.e), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), num_splits,
        block_tables.shape[1] * block_size,
        H=H, G=H // K, D=D, BLOCK_G=max(16, triton.next_power_of_2(H // K)), BLOCK_D=BLOCK_D, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, SPLIT=num_splits > 1, UPCAST=interpreting(), PRECISION=_dot_precision(q.dtype), PEEL=peel,
        num_warps=num_warps, num_stages=num_stages, PDL=pdl, launch_pdl=pdl)
    return merge_splits(out, part_out, part_m, part_l, num_splits, pdl)


# ---- bounds: the library kernel with its arithmetic taken away, to see what the loads alone cost


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _bound_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, lens_ptr, out_ptr, part_out_ptr, part_m_ptr, part_l_ptr,
                  qk_scale, stride_qb, stride_qh, stride_ob, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
                  num_splits, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                  PRECISION: tl.constexpr, DOTS: tl.constexpr, PDL: tl.constexpr):
    """Chapter 9's decode kernel (same grid, splits, tiles and gather) without the online softmax: with DOTS the two
    products stay (scores cast straight to the values' type), without them each tile's keys and values are only summed."""
    _follow_early(PDL)
    kh, b, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    S = tl.load(lens_ptr + b)
    split_len = ((S + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, S)
    offs_g, offs_d, offs_n = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
    heads = kh * G + offs_g
    g_mask, d_mask = offs_g < G, offs_d < D
    gd_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gd_mask, other=0.0)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    sums = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + offs_n
        n_mask = n < end
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_ptr + b * stride_bt, n, n_mask, kh * stride_ch,
                             offs_d, d_mask, stride_cb, stride_cs, BLOCK_SIZE, False)
        if DOTS:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            acc += tl.dot(s.to(v.dtype), v, input_precision=PRECISION)
        else:
            sums += k.to(tl.float32) + v.to(tl.float32)
    if not DOTS:
        acc += tl.sum(sums, 0)[None, :]
    m_i = tl.full([BLOCK_G], 0.0, tl.float32)
    l_i = tl.full([BLOCK_G], 1.0, tl.float32)
    _store_decode_result(out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, acc, m_i, l_i, b, heads, split, num_splits,
                         stride_ob, stride_oh, offs_d, g_mask, gd_mask, H, D, SPLIT)


def bound_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out=None, dots=True):
    "The library's splits, tiles and merge around _bound_kernel: a time with no softmax (dots) or no arithmetic at all."
    _, block_size, K, D = k_cache.shape
    B, H, _ = q.shape
    out = torch.empty_like(q) if out is None else out
    sms = kernels._num_sms(q.device)
    num_splits = kernels.decode_num_splits(q, k_cache, block_tables)
    block_n, num_warps, num_stages = kernels.decode_tile(K * B * num_splits / sms, D)
    pdl = _pdl(q.device)
    part_out, part_m, part_l = split_partials(B, H, num_splits, D, q.device)
    _bound_kernel[(K, B, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_m, part_l,
        scale * math.log2(math.e), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), num_splits,
        H=H, G=H // K, D=D, BLOCK_G=max(16, triton.next_power_of_2(H // K)), BLOCK_D=triton.next_power_of_2(D),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=num_splits > 1, PRECISION=_dot_precision(q.dtype), DOTS=dots,
        num_warps=num_warps, num_stages=num_stages, PDL=pdl, launch_pdl=pdl)
    return merge_splits(out, part_out, part_m, part_l, num_splits, pdl)


# ---- TMA: one tensor-descriptor box per (block, KV head)


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _tma_decode_kernel(q_ptr, k_desc, v_desc, bt_ptr, lens_ptr, out_ptr, part_out_ptr, part_m_ptr, part_l_ptr,
                       qk_scale, stride_qb, stride_qh, stride_ob, stride_oh, stride_bt, num_splits,
                       H: tl.constexpr, K: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr, SPLIT: tl.constexpr,
                       UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    _follow_early(PDL)
    kh, b, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    BLOCK_N: tl.constexpr = BLOCKS_PER_TILE * BLOCK_SIZE
    S = tl.load(lens_ptr + b)
    split_len = ((S + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # as the library kernel
    start = split * split_len
    end = tl.minimum(start + split_len, S)
    offs_g, offs_d, offs_j = tl.arange(0, BLOCK_G), tl.arange(0, D), tl.arange(0, BLOCK_SIZE)
    heads = kh * G + offs_g
    g_mask = offs_g < G
    gd_mask = g_mask[:, None] & (offs_d < D)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gd_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, D], 0.0, tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        for j in tl.static_range(BLOCKS_PER_TILE):
            first = n0 + j * BLOCK_SIZE  # tiles start on block boundaries, so this box is one whole block
            block = tl.load(bt_row + first // BLOCK_SIZE, mask=first < end, other=0)
            row = (block * K + kh) * BLOCK_SIZE  # head kh's rows of the block in the (blocks * K * block_size, D) pool
            k = k_desc.load([row, 0])
            v = v_desc.load([row, 0])
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            valid = (first + offs_j < end)[None, :]
            acc, m_i, l_i = _online_softmax_step(q, k, v, valid, acc, m_i, l_i, qk_scale, PRECISION)
    _store_decode_result(out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, acc, m_i, l_i, b, heads, split, num_splits,
                         stride_ob, stride_oh, offs_d, g_mask, gd_mask, H, D, SPLIT)


def pool_rows(cache: torch.Tensor) -> torch.Tensor:
    "A head-major pool (blocks, block_size, K, D) (PagedKVCache's) as the (blocks * K * block_size, D) rows a descriptor reads."
    n, bs, K, D = cache.shape
    if not cache.transpose(1, 2).is_contiguous():
        raise ValueError(f"TMA decode needs a head-major pool (blocks, K, block_size, D) underneath; strides {cache.stride()}")
    return cache.as_strided((n * K * bs, D), (D, 1))


def tma_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out=None, tile=(4, 4, 5), num_splits=None):
    "Decode attention with the library's splits and merge; tile = (blocks per iteration, num_warps, num_stages)."
    from triton.tools.tensor_descriptor import TensorDescriptor
    _, block_size, K, D = k_cache.shape
    B, H, _ = q.shape
    out = torch.empty_like(q) if out is None else out
    if num_splits is None:
        num_splits = kernels.choose_num_splits(B, K, block_tables.shape[1] * block_size, kernels._num_sms(q.device))
    k_desc = TensorDescriptor.from_tensor(pool_rows(k_cache), [block_size, D])
    v_desc = TensorDescriptor.from_tensor(pool_rows(v_cache), [block_size, D])
    pdl = _pdl(q.device)
    part_out, part_m, part_l = split_partials(B, H, num_splits, D, q.device)
    blocks_per_tile, num_warps, num_stages = tile
    _tma_decode_kernel[(K, B, num_splits)](
        q, k_desc, v_desc, block_tables, context_lens, out, part_out, part_m, part_l,
        scale * math.log2(math.e), q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        num_splits, H=H, K=K, G=H // K, D=D, BLOCK_G=max(16, triton.next_power_of_2(H // K)), BLOCK_SIZE=block_size,
        BLOCKS_PER_TILE=blocks_per_tile, SPLIT=num_splits > 1, UPCAST=interpreting(), PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages, PDL=pdl, launch_pdl=pdl)
    return merge_splits(out, part_out, part_m, part_l, num_splits, pdl)


# ---- checks and measurements


def cpu_check() -> dict:
    "Both designs against the library kernel on ragged float32 batches (empty contexts included), in the interpreter."
    if not interpreting():
        sys.exit("--cpu-check needs TRITON_INTERPRET=1 set before triton is imported")
    torch.manual_seed(0)
    worst = {"stream-K": 0.0, "interleaved": 0.0, "TMA": 0.0}
    head_major = lambda c: c.transpose(1, 2).contiguous().transpose(1, 2)  # same values, PagedKVCache's storage order
    for (K, G, D, bs), lens in itertools.product([(2, 4, 64, 16), (1, 3, 32, 32)], [[1, 15, 16, 17, 100, 0, 33], [300]]):
        B, nb = len(lens), max(1, max(triton.cdiv(n, bs) for n in lens))
        k_cache, v_cache = torch.randn(B * nb + 2, bs, K, D), torch.randn(B * nb + 2, bs, K, D)
        tables = torch.randperm(B * nb + 2)[:B * nb].view(B, nb).int()
        context_lens, q = torch.tensor(lens, dtype=torch.int32), torch.randn(B, K * G, D)
        ref = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, D**-0.5, num_splits=1)
        for programs, tile in [(1, (16, 4, 2)), (7, (32, 4, 2)), (40, (16, 4, 2))]:  # 40 > the tiles: empty ranges
            got = stream_k_decode(q, k_cache, v_cache, tables, context_lens, D**-0.5, tile=tile, programs=programs)
            worst["stream-K"] = max(worst["stream-K"], (got - ref).abs().max().item())
        for peel, (splits, tile) in itertools.product((True, False), [(None, None), (1, (16, 4, 5)), (3, (32, 4, 5))]):
            got = interleaved_decode(q, k_cache, v_cache, tables, context_lens, D**-0.5, peel=peel, num_splits=splits,
                                     tile=tile)
            worst["interleaved"] = max(worst["interleaved"], (got - ref).abs().max().item())
        for tile, splits in [((1, 4, 2), None), ((2, 4, 5), 3), ((4, 2, 3), 1)]:
            got = tma_decode(q, head_major(k_cache), head_major(v_cache), tables, context_lens, D**-0.5, tile=tile,
                             num_splits=splits)
            worst["TMA"] = max(worst["TMA"], (got - ref).abs().max().item())
    return worst


def measure(models, cells, designs, log) -> list:
    "Per (model, B, S): the library kernel, the chosen designs (stream-K, interleaved, deep, TMA, blocks) and SDPA (us)."
    import paged_attention as pa
    us = pa.graphed_us
    rows = []
    for model, (B, S) in itertools.product(models, cells):
        H, K, D = pa.MODELS[model]
        q, k_cache, v_cache, tables, lens, out, scale, ref = pa.decode_case(model, B, S)
        sms = kernels._num_sms(q.device)
        runs = {"library": lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, out=out)}
        if "stream-K" in designs:
            for tile, pps in itertools.product(STREAM_K_TILES[D], (2, 3)):
                runs[f"stream-K/n{tile[0]}w{tile[1]}s{tile[2]}/{pps} per SM"] = (
                    lambda tile=tile, pps=pps: stream_k_decode(q, k_cache, v_cache, tables, lens, scale, out, tile, pps * sms))
        if "interleaved" in designs:
            runs["interleaved"] = lambda: interleaved_decode(q, k_cache, v_cache, tables, lens, scale, out, peel=False)
            runs["interleaved, peeled"] = lambda: interleaved_decode(q, k_cache, v_cache, tables, lens, scale, out)
        if "deep" in designs and B == 8 and S == 512:
            for splits, tile in DEEP[D]:
                runs[f"library/{splits} splits/n{tile[0]}w{tile[1]}s{tile[2]}"] = lambda splits=splits, tile=tile: (
                    _with_tile(tile, lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, splits, out)))
            for (splits, tile), peel in itertools.product(PEEL_AT_DEPTH, (False, True)):  # a peel with tiles behind it
                runs[f"interleaved{', peeled' if peel else ''}/{splits} splits/n{tile[0]}w{tile[1]}s{tile[2]}"] = (
                    lambda splits=splits, tile=tile, peel=peel: interleaved_decode(
                        q, k_cache, v_cache, tables, lens, scale, out, peel, splits, tile))
        if "wide" in designs:
            for tile, splits in itertools.product(WIDE_TILES[D], WIDE_SPLITS[B]):
                if splits == 1 or S // splits >= 128:  # no split shorter than the library's shortest
                    runs[f"library/{splits} splits/n{tile[0]}w{tile[1]}s{tile[2]}"] = lambda splits=splits, tile=tile: (
                        _with_tile(tile, lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, splits, out)))
        if "fill" in designs:
            for tile, splits in itertools.product(FILL_TILES[D], FILL_SPLITS[B]):
                if splits == 1 or S // splits >= 128:
                    runs[f"library/{splits} splits/n{tile[0]}w{tile[1]}s{tile[2]}"] = lambda splits=splits, tile=tile: (
                        _with_tile(tile, lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, splits, out)))
        if "bound" in designs:  # not attention: times only, their errors are meaningless
            runs["bound/no softmax"] = lambda: bound_decode(q, k_cache, v_cache, tables, lens, scale, out, dots=True)
            runs["bound/loads only"] = lambda: bound_decode(q, k_cache, v_cache, tables, lens, scale, out, dots=False)
            one_block = torch.zeros_like(tables)  # every position reads block 0: the same kernel with its keys in cache
            runs["bound/library, keys in cache"] = (
                lambda: paged_decode_attention(q, k_cache, v_cache, one_block, lens, scale, out=out))
        if "TMA" in designs:
            for tile in TMA_TILES[D]:
                runs[f"TMA/b{tile[0]}w{tile[1]}s{tile[2]}"] = (
                    lambda tile=tile: tma_decode(q, k_cache, v_cache, tables, lens, scale, out, tile))
        runs["library again"] = runs["library"]
        row = {"model": model, "batch": B, "context": S, "us": {}, "max_abs_error": {}, "failed": {}}
        pa.time_designs(runs, out, ref, row, log)
        if "blocks" in designs:
            order = torch.arange(tables.numel(), device=tables.device, dtype=torch.int32).view_as(tables)
            row["us"]["library/blocks in order"] = us(lambda: paged_decode_attention(q, k_cache, v_cache, order, lens, scale, out=out))
        k4, v4 = pa.contiguous_kv(k_cache, tables, S), pa.contiguous_kv(v_cache, tables, S)
        del k_cache, v_cache
        row["sdpa_us"] = min(us(pa.sdpa_call(q[:, :, None], k4, v4, scale, pa.sdpa_backends()[n])) for n in ("default", "cudnn"))
        del k4, v4
        for bs in BLOCK_SIZES if "blocks" in designs else ():
            qb, kb, vb, tb, lb = pa.paged_inputs(B, S, H, K, D, bs)
            row["us"][f"library/blocks of {bs}"] = us(lambda: paged_decode_attention(qb, kb, vb, tb, lb, scale))
            del qb, kb, vb, tb, lb
        torch.cuda.empty_cache()
        row["sdpa_time_over_ours"] = {n: round(row["sdpa_us"] / t, 3) for n, t in row["us"].items()}
        best = max(row["sdpa_time_over_ours"], key=row["sdpa_time_over_ours"].get)
        log(f"{model} B={B} S={S}: SDPA {row['sdpa_us']} us, library {row['us']['library']} us, best {best} {row['us'][best]} us")
        rows.append(row)
    return rows


def pipeline_buffers(stages=range(1, 10), head_dim=64, block_n=128, num_warps=4) -> tuple[dict, dict]:
    """num_stages -> how many (BLOCK_N, D) key buffers Triton's pipeliner gives the library kernel, compiled for sm_90 (no
    GPU needed), and num_stages -> the loop's schedule of waits, copies and products (loop_schedule)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = kernels._decode_kernel
    ptrs = {"q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "part_out_ptr", "part_m_ptr", "part_l_ptr", "bt_ptr", "lens_ptr"}
    types = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16", "bt_ptr": "*i32",
             "lens_ptr": "*i32", "part_out_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "qk_scale": "fp32"}
    constexprs = dict(H=32, G=4, D=head_dim, BLOCK_G=16, BLOCK_D=head_dim, BLOCK_SIZE=16, BLOCK_N=block_n, SPLIT=False,
                      UPCAST=False, PRECISION="tf32", PDL=False, WINDOWED=False, FP16_DOTS=False)
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
    # as at a launch on the engine's pools: pointers and strides are multiples of 16 (stride_bt is not specialized)
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if name in ptrs or name.startswith("stride_") and name != "stride_bt"}
    buffers, schedules = {}, {}
    for num_stages in stages:
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
        ttgir = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages)).asm["ttgir"]
        shapes = re.findall(rf"local_alloc : \(\) -> !ttg.memdesc<(\d+)x{block_n}x{head_dim}xbf16", ttgir)
        buffers[num_stages] = int(shapes[0]) if shapes else 0  # 0: loaded straight into registers
        schedules[num_stages] = loop_schedule(ttgir)
    return buffers, schedules


def loop_schedule(ttgir: str) -> list[str]:
    """The order of the decode loop's waits, copies and products in compiled TTGIR: "wait N" (until at most N groups of
    copies are still in flight), "copy" (an asynchronous copy into shared memory), "dot"."""
    loop = ttgir.index("scf.for")  # the body opens with the last brace of the loop's line (its types hold balanced ones)
    start = ttgir.rindex("{", loop, ttgir.index("\n", loop))  # then match braces to its end, nested regions and all
    depth, end = 0, start
    for end, ch in enumerate(ttgir[start:], start):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0: break
    ops = re.findall(r"ttg\.async_wait[^{]*\{num = (\d+)|(ttg\.async_copy_global_to_local)|(tt\.dot |warp_group_dot )",
                     ttgir[start:end])
    return [f"wait {w}" if w else "copy" if c else "dot" for w, c, _ in ops]


def _with_tile(tile, fn):
    "Run fn with nanoserve.kernels.decode_tile forced to `tile`."
    import paged_attention as pa
    with pa.forced_decode(tile): return fn()


STREAM_K_TILES = {64: [(128, 4, 3), (64, 2, 3)], 128: [(64, 4, 3), (64, 4, 2)]}  # the best of a wider screen
DEEP_AT_3C03A90 = [(1, (128, 4, 5)), (1, (64, 4, 6)), (2, (128, 4, 5)), (2, (64, 4, 6)), (4, (128, 4, 3))]
DEEP = {  # (splits, tile) at batch 8 x context 512: 9 stages hold four tiles (2-3 for D=128, as shared memory allows);
    # one stage and a tile of the whole split: every load of the program issued at once, no loop to pipeline
    64: DEEP_AT_3C03A90 + [(1, (128, 4, 9)), (1, (128, 8, 9)), (1, (64, 2, 9)), (2, (128, 4, 7)), (2, (64, 4, 9)),
                           (1, (512, 8, 1)), (1, (512, 16, 1)), (2, (256, 8, 1)), (2, (256, 4, 1))],
    128: DEEP_AT_3C03A90 + [(1, (64, 4, 9)), (1, (128, 4, 7)), (1, (128, 8, 7)), (2, (64, 4, 9)), (2, (128, 4, 5)),
                            (1, (512, 16, 1)), (1, (256, 8, 1)), (1, (256, 8, 2)), (2, (256, 8, 1)), (2, (256, 16, 1))]}
PEEL_AT_DEPTH = [(1, (128, 4, 5)), (2, (128, 4, 5)), (1, (64, 4, 5)),  # (splits, tile): 2-4 tiles per split at S=512,
                 (4, (128, 4, 3)), (4, (128, 4, 1))]  # and one: a peel with nothing behind it to delay
TMA_TILES = {64: [(1, 4, 9), (2, 4, 7), (4, 4, 5), (4, 4, 3), (8, 4, 5)],  # (blocks per iteration, warps, stages)
             128: [(1, 4, 9), (2, 4, 7), (4, 4, 5), (4, 4, 3), (8, 4, 3)]}
WIDE_TILES = {64: [(128, 4, 3), (128, 8, 3), (256, 4, 3), (256, 8, 3), (256, 4, 2), (256, 8, 1)],  # 256 keys of 64:
              128: [(128, 4, 3), (128, 8, 3), (64, 2, 3), (64, 4, 3)]}  # the bytes per tile of 128 keys of 128
WIDE_SPLITS = {8: [4, 6, 7, 9, 12, 16], 64: [1, 2, 3, 4, 5], 256: [1, 2]}
FILL_TILES = {  # (BLOCK_N, warps, stages): 7 stages hold three tiles, 5 two (--buffers); 64/4/7 and 32/x/7 fit 4 programs an SM
    64: [(128, 4, 3), (64, 4, 7), (64, 2, 7), (64, 4, 5), (64, 4, 6), (128, 4, 5), (64, 4, 9)],
    128: [(128, 4, 3), (64, 2, 3), (32, 2, 7), (32, 4, 7), (64, 4, 5), (32, 4, 5), (32, 2, 9)]}
FILL_SPLITS = {8: [4, 7, 8, 9, 12, 16], 64: [1, 2], 256: [1]}
DESIGNS = ("stream-K", "interleaved", "deep", "TMA", "blocks", "wide", "fill", "bound")
BLOCK_SIZES = (32, 64, 256)
CELLS = [(b, s) for b in (8, 64, 256) for s in (512, 4096, 16384)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--models", nargs="+", default=["Llama-3.2-1B", "Qwen3-0.6B"])
    ap.add_argument("--cpu-check", action="store_true", help="correctness only, TRITON_INTERPRET=1, float32")
    ap.add_argument("--designs", nargs="+", default=list(DESIGNS), choices=DESIGNS, help="default: all")
    ap.add_argument("--buffers", action="store_true", help="print how many key buffers each num_stages gets (compiles "
                    "for sm_90; no GPU needed) and exit")
    args = ap.parse_args(argv)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)
    if args.buffers:
        buffers, schedules = pipeline_buffers()
        print(json.dumps({"triton": triton.__version__, "kernel": "_decode_kernel, BLOCK_N 128, D 64, 4 warps, sm_90",
                          "num_stages -> key buffers": buffers, "num_stages -> loop schedule": schedules}))
        return
    if args.cpu_check:
        worst = cpu_check()
        log(f"max abs error against the library kernel: {worst}")
        sys.exit(0 if max(worst.values()) < 1e-4 else 1)
    sys.path.insert(0, str(Path(__file__).parent))
    import paged_attention as pa
    t0 = time.monotonic()
    res = {**pa.run_header("decode_alternatives"), "designs": args.designs, "rows": measure(args.models, CELLS, args.designs, log)}
    res["elapsed_s"] = round(time.monotonic() - t0, 1)
    pa.emit(res, args.out)


if __name__ == "__main__":
    main()
