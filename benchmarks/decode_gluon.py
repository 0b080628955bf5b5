"""A warp-specialised paged decode kernel for Hopper, written in Gluon, measured against chapter 9's and SDPA.

Chapter 13's sweeps left every Triton design of the decode kernel behind cuDNN's SDPA at batch 64, and the bounds of
decode_alternatives.py (--designs bound) showed why: chapter 9's kernel with its softmax taken out, or with nothing
but its loads, is still slower there. FlashAttention 3's Hopper kernels give their loads warps of their own, which
Triton's pipeliner cannot do. This kernel does, in Gluon (Triton's lower-level language, where layouts, shared memory
and barriers are written out):

  a load warp    walks the split's block ids and copies each (block, KV head) of 16 positions with the tensor-memory
                 accelerator (TMA) into a ring of STAGES shared-memory tiles of BLOCK_N positions; an mbarrier per
                 tile says when its bytes have landed, another when the attention warps are done with it;
  4 warps        wait for a tile, read keys and values into registers, free the tile at once, and run chapter 9's
                 online-softmax step on tensor cores (mma.sync, the G query heads of a KV head padded to 16 rows).

The grid, the split of a context, the partial results and the merge kernel are chapter 9's. The benchmark times the
kernel at chapter 9's split count and at the counts that fill one and two waves of its own programs (read from the
compiled kernel), and chapter 9's kernel at the same counts. Hopper only (TMA, warp specialisation), and Triton 3.6 or
later; under TRITON_INTERPRET nothing here runs.

    python benchmarks/decode_gluon.py --out decode_gluon.json     # check against the library kernel, then time
    python benchmarks/decode_gluon.py --bound                      # also the load warp alone (no attention)
    python benchmarks/decode_gluon.py --compile     # what each variant compiles to for sm_90 (no GPU needed)

Times are the median of triton.testing.do_bench over CUDA-graph replays with L2 flushed, as paged_attention.py.
Progress goes to stderr; stdout gets only the JSON.
"""
import argparse, itertools, json, math, sys, time
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, mma_v2, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROOT = Path(__file__).resolve().parents[1]
try:
    import nanoserve  # noqa: F401
except ImportError:  # not installed: run from the checkout
    sys.path.insert(0, str(ROOT))
import nanoserve.kernels as kernels
from nanoserve.kernels import _decode_reduce_kernel, paged_decode_attention

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # renamed after Triton 3.6


@gluon.jit
def _split_range(lens_ptr, b, split, num_splits, BLOCK_N: gl.constexpr):
    "Chapter 9's split of a context: positions [start, end) of split `split`, in whole tiles."
    S = gl.load(lens_ptr + b)
    split_len = ((S + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * split_len
    return start, gl.minimum(start + split_len, S)


@gluon.jit
def _load_partition(k_desc, v_desc, bt_ptr, lens_ptr, stride_bt, num_splits, k_bufs, v_bufs, ready, empty,
                    K: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    "One warp: copy each tile's blocks of this KV head into the ring, a TMA box per block."
    kh, b, split = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    start, end = _split_range(lens_ptr, b, split, num_splits, BLOCK_N)
    bt_row = bt_ptr + b * stride_bt
    BOXES: gl.constexpr = BLOCK_N // BLOCK_SIZE
    i = 0
    for n0 in range(start, end, BLOCK_N):
        stage = i % STAGES
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)  # a fresh barrier counts as freed once
        mbarrier.expect(ready.index(stage), 2 * BOXES * k_desc.block_type.nbytes)
        for j in gl.static_range(BOXES):  # a box past the context copies block 0, which the attention masks
            first = n0 + j * BLOCK_SIZE
            block = gl.load(bt_row + first // BLOCK_SIZE, mask=first < end, other=0)
            row = (block * K + kh) * BLOCK_SIZE
            _tma_load(k_desc, [row, 0], ready.index(stage), k_bufs.index(stage).slice(j * BLOCK_SIZE, BLOCK_SIZE))
            _tma_load(v_desc, [row, 0], ready.index(stage), v_bufs.index(stage).slice(j * BLOCK_SIZE, BLOCK_SIZE))
        i += 1


@gluon.jit
def _attend_partition(q_ptr, lens_ptr, out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, k_bufs, v_bufs, ready, empty,
                      qk_scale, stride_qb, stride_qh, stride_ob, stride_oh, num_splits,
                      H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, BLOCK_G: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, SPLIT: gl.constexpr, NUM_WARPS: gl.constexpr, BOUND: gl.constexpr):
    "The default warps: chapter 9's online softmax over the ring's tiles (BOUND: only take and free them)."
    kh, b, split = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    start, end = _split_range(lens_ptr, b, split, num_splits, BLOCK_N)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    rows: gl.constexpr = gl.SliceLayout(1, mma)
    cols: gl.constexpr = gl.SliceLayout(0, mma)
    offs_g, offs_d, offs_n = gl.arange(0, BLOCK_G, layout=rows), gl.arange(0, D, layout=cols), gl.arange(0, BLOCK_N, layout=cols)
    heads = kh * G + offs_g
    g_mask = offs_g < G
    gd_mask = g_mask[:, None] & (offs_d < D)[None, :]
    q = gl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gd_mask, other=0.0)
    q = gl.convert_layout(q, a_op)
    m_i = gl.full([BLOCK_G], float("-inf"), gl.float32, rows)
    l_i = gl.zeros([BLOCK_G], gl.float32, rows)
    acc = gl.zeros([BLOCK_G, D], gl.float32, mma)
    i = 0
    for n0 in range(start, end, BLOCK_N):
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        if BOUND:
            fence_async_shared()
            mbarrier.arrive(empty.index(stage), count=1)
        else:
            k = k_bufs.index(stage).permute((1, 0)).load(b_op)  # (D, BLOCK_N)
            v = v_bufs.index(stage).load(b_op)  # (BLOCK_N, D)
            fence_async_shared()  # the reads above come before the next copy into this tile
            mbarrier.arrive(empty.index(stage), count=1)
            s = mma_v2(q, k, gl.zeros([BLOCK_G, BLOCK_N], gl.float32, mma)) * qk_scale
            s = gl.where((n0 + offs_n < end)[None, :], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            acc = mma_v2(gl.convert_layout(p.to(v.dtype), a_op), v, acc * alpha[:, None])
            m_i = m_new
        i += 1
    if SPLIT:
        part = (b * H + heads) * num_splits + split
        gl.store(part_m_ptr + part, m_i, mask=g_mask)
        gl.store(part_l_ptr + part, l_i, mask=g_mask)
        gl.store(part_out_ptr + part[:, None] * D + offs_d[None, :], acc, mask=gd_mask)
    else:
        o = acc / gl.where(l_i == 0.0, 1.0, l_i)[:, None]
        gl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gd_mask)


@gluon.jit
def _attend_per_warp_partition(q_ptr, lens_ptr, out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, k_bufs, v_bufs, ready,
                               empty, qk_scale, stride_qb, stride_qh, stride_ob, stride_oh, num_splits,
                               H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, BLOCK_G: gl.constexpr,
                               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, W: gl.constexpr):
    """The default warps, each on its own BLOCK_N / W positions of every tile with its own running max, sum and output,
    so no step waits for another warp; the W partial results are merged once, at the end (flash-decoding inside one
    program). A batched mma: dimension 0 is the warp."""
    kh, b, split = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    start, end = _split_range(lens_ptr, b, split, num_splits, BLOCK_N)
    NW: gl.constexpr = BLOCK_N // W
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    KW: gl.constexpr = 8 if NW >= 32 else 4  # an operand's K must be at least 4 * k_width
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)
    wg: gl.constexpr = gl.SliceLayout(2, mma)  # (W, G): a warp's running max and sum per query head
    wn: gl.constexpr = gl.SliceLayout(1, mma)  # (W, NW): the positions each warp reads
    gd: gl.constexpr = gl.SliceLayout(0, mma)  # (G, D): the merged output
    offs_w = gl.arange(0, W, layout=gl.SliceLayout(1, wg))
    offs_g = gl.arange(0, BLOCK_G, layout=gl.SliceLayout(0, wg))
    offs_d3 = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))
    heads = kh * G + offs_g
    q_ptrs = q_ptr + b * stride_qb + heads[None, :, None] * stride_qh + offs_d3[None, None, :] + 0 * offs_w[:, None, None]
    q = gl.load(q_ptrs, mask=(offs_g < G)[None, :, None], other=0.0)  # (W, G, D): every warp its own copy
    q = gl.convert_layout(q, a_op)
    pos = (gl.arange(0, W, layout=gl.SliceLayout(1, wn))[:, None] * NW
           + gl.arange(0, NW, layout=gl.SliceLayout(0, wn))[None, :])  # (W, NW) offsets in a tile
    m_i = gl.full([W, BLOCK_G], float("-inf"), gl.float32, wg)
    l_i = gl.zeros([W, BLOCK_G], gl.float32, wg)
    acc = gl.zeros([W, BLOCK_G, D], gl.float32, mma)
    i = 0
    for n0 in range(start, end, BLOCK_N):
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        k = k_bufs.index(stage).reshape([W, NW, D]).permute((0, 2, 1)).load(b_op)  # (W, D, NW)
        v = v_bufs.index(stage).reshape([W, NW, D]).load(b_op)  # (W, NW, D)
        fence_async_shared()
        mbarrier.arrive(empty.index(stage), count=1)
        s = mma_v2(q, k, gl.zeros([W, BLOCK_G, NW], gl.float32, mma)) * qk_scale
        s = gl.where((n0 + pos < end)[:, None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 2))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # a warp may have seen no position yet
        alpha = gl.exp2(m_i - m_ref)
        p = gl.exp2(s - m_ref[:, :, None])
        l_i = l_i * alpha + gl.sum(p, 2)
        acc = mma_v2(gl.convert_layout(p.to(v.dtype), a_op), v, acc * alpha[:, :, None])
        m_i = m_new
        i += 1
    m = gl.max(m_i, 0)  # (G,) across the warps
    weight = gl.exp2(m_i - gl.where(m == float("-inf"), 0.0, m)[None, :])  # (W, G)
    l_sum = gl.sum(l_i * weight, 0)
    o = gl.sum(acc * weight[:, :, None], 0)  # (G, D)
    offs_gr = gl.arange(0, BLOCK_G, layout=gl.SliceLayout(1, gd))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, gd))
    gd_mask = (offs_gr < G)[:, None] & (offs_d < D)[None, :]
    if SPLIT:
        part = (b * H + heads) * num_splits + split
        gl.store(part_m_ptr + part, m, mask=offs_g < G)
        gl.store(part_l_ptr + part, l_sum, mask=offs_g < G)
        part_r = (b * H + kh * G + offs_gr) * num_splits + split
        gl.store(part_out_ptr + part_r[:, None] * D + offs_d[None, :], o, mask=gd_mask)
    else:
        l_r = gl.convert_layout(l_sum, gl.SliceLayout(1, gd))
        o = o / gl.where(l_r == 0.0, 1.0, l_r)[:, None]
        gl.store(out_ptr + b * stride_ob + (kh * G + offs_gr)[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gd_mask)


@gluon.jit
def _ws_decode_kernel(q_ptr, k_desc, v_desc, bt_ptr, lens_ptr, out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, qk_scale,
                      stride_qb, stride_qh, stride_ob, stride_oh, stride_bt, num_splits,
                      H: gl.constexpr, G: gl.constexpr, K: gl.constexpr, D: gl.constexpr, BLOCK_G: gl.constexpr,
                      BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                      NUM_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr, BOUND: gl.constexpr, PER_WARP: gl.constexpr):
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    if PER_WARP:
        gl.warp_specialize([(_attend_per_warp_partition, (
            q_ptr, lens_ptr, out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, k_bufs, v_bufs, ready, empty, qk_scale,
            stride_qb, stride_qh, stride_ob, stride_oh, num_splits, H, G, D, BLOCK_G, BLOCK_N, STAGES, SPLIT, NUM_WARPS)),
            (_load_partition, (k_desc, v_desc, bt_ptr, lens_ptr, stride_bt, num_splits, k_bufs, v_bufs, ready,
                                 empty, K, BLOCK_SIZE, BLOCK_N, STAGES))], [1], [LOAD_REGS])
    else:
        gl.warp_specialize([(_attend_partition, (
            q_ptr, lens_ptr, out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, k_bufs, v_bufs, ready, empty, qk_scale,
            stride_qb, stride_qh, stride_ob, stride_oh, num_splits, H, G, D, BLOCK_G, BLOCK_N, STAGES, SPLIT, NUM_WARPS,
            BOUND)),
            (_load_partition, (k_desc, v_desc, bt_ptr, lens_ptr, stride_bt, num_splits, k_bufs, v_bufs, ready,
                                 empty, K, BLOCK_SIZE, BLOCK_N, STAGES))], [1], [LOAD_REGS])


def pool_rows(cache: torch.Tensor) -> torch.Tensor:
    "A head-major pool (blocks, block_size, K, D) as the (blocks * K * block_size, D) rows a descriptor reads."
    n, bs, K, D = cache.shape
    if cache.stride() != (bs * K * D, D, bs * D, 1):
        raise ValueError("the pool is not head-major (PagedKVCache's storage order)")
    return cache.permute(0, 2, 1, 3).reshape(n * K * bs, D)


GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
COMPILED = {}  # (tile, head_dim, bound) -> the compiled kernel of the last launch


def ws_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out=None, num_splits=None, tile=(128, 2, 128, 4, True),
              load_regs=40, bound=False):
    """Paged decode attention by _ws_decode_kernel with chapter 9's splits (or these) and merge;
    tile = (BLOCK_N, STAGES, maxnreg, attention warps, each warp on its own positions)."""
    block_n, stages, maxnreg, num_warps, per_warp = tile
    _, block_size, K, D = k_cache.shape
    if block_n % block_size:
        raise ValueError(f"BLOCK_N={block_n} must be a multiple of the block size {block_size}: a TMA box is one block")
    B, H, _ = q.shape
    out = torch.empty_like(q) if out is None else out
    num_splits = num_splits or kernels.decode_num_splits(q, k_cache, block_tables)
    layout = gl.NVMMASharedLayout.get_default_for([block_size, D], GL_DTYPES[k_cache.dtype])
    k_desc = TensorDescriptor.from_tensor(pool_rows(k_cache), [block_size, D], layout)
    v_desc = TensorDescriptor.from_tensor(pool_rows(v_cache), [block_size, D], layout)
    part_m = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    part_out, part_l = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device), torch.empty_like(part_m)
    COMPILED[tile, D, bound] = _ws_decode_kernel[(K, B, num_splits)](
        q, k_desc, v_desc, block_tables, context_lens, out, part_out, part_m, part_l, scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), num_splits,
        H=H, G=H // K, K=K, D=D, BLOCK_G=max(16, triton.next_power_of_2(H // K)), BLOCK_SIZE=block_size,
        BLOCK_N=block_n, STAGES=stages, SPLIT=num_splits > 1, NUM_WARPS=num_warps, LOAD_REGS=load_regs, BOUND=bound,
        PER_WARP=per_warp and not bound, num_warps=num_warps, maxnreg=maxnreg)
    if num_splits > 1:
        _decode_reduce_kernel[(B, H)](out, part_out, part_m, part_l, out.stride(0), out.stride(1), num_splits, H=H, D=D,
                                      BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=triton.next_power_of_2(D),
                                      PDL=False)
    return out


def check(log) -> dict:
    "The kernel against the library's on ragged bf16 batches (lengths on and past block and tile edges), both shapes."
    import paged_attention as pa
    worst = {}
    lens_list = [1, 15, 16, 17, 127, 128, 129, 1000, 4096, 333, 2048, 9000]
    for model, (H, K, D) in pa.MODELS.items():
        torch.manual_seed(0)
        B, bs = len(lens_list), 16
        nb = max(triton.cdiv(n, bs) for n in lens_list)
        k_cache, v_cache = pa.random_pools(B * nb, bs, K, D)
        tables = torch.randperm(B * nb, device="cuda").view(B, nb).int()
        lens = torch.tensor(lens_list, dtype=torch.int32, device="cuda")
        q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
        ref = paged_decode_attention(q, k_cache, v_cache, tables, lens, D**-0.5, num_splits=1).float()
        for splits, tile in itertools.product((1, 3, 8), VARIANTS[D]):
            got = ws_decode(q, k_cache, v_cache, tables, lens, D**-0.5, torch.full_like(q, float("nan")), splits, tile)
            worst[f"{model} splits={splits} {tile_name(tile)}"] = (got.float() - ref).abs().max().item()
    log(f"max abs error against the library kernel: {max(worst.values())}")
    return worst


VARIANTS = {  # head_dim -> (BLOCK_N, STAGES, maxnreg, attention warps, per warp): maxnreg 128 leaves registers for 2
    # programs an SM, 80 for 3 (4 warps) or 2 (8 warps), before shared memory counts; a stage is 32 KB of keys and values
    64: [(128, 2, 128, 4, False), (128, 2, 128, 4, True), (128, 3, 128, 4, True), (128, 2, 80, 4, True),
         (128, 2, 80, 8, True)],
    128: [(64, 2, 128, 4, False), (64, 2, 128, 4, True), (64, 3, 128, 4, True), (64, 2, 80, 4, True)]}


def tile_name(tile) -> str:
    block_n, stages, maxnreg, warps, per_warp = tile
    return f"n{block_n}s{stages}r{maxnreg}w{warps}{'p' if per_warp else ''}"


def resident(tile, head_dim: int, bound: bool = False) -> int:
    """Programs an SM holds of the compiled kernel (after a launch): its registers are maxnreg for each of its attention
    warps and the load warp's group of 4, and its shared memory the ring, the barriers and the compiler's scratch."""
    _, _, maxnreg, warps, _ = tile
    kernel = COMPILED[tile, head_dim, bound]
    return kernels.resident_programs(maxnreg, kernel.metadata.shared, warps + 4, **kernels._sm_limits(torch.device("cuda")))


CELLS = [(b, s) for b in (8, 64, 256) for s in (512, 4096, 16384)]
TOLERANCE = 0.02  # largest error against chapter 9's kernel in bf16


def measure(models, bound, log) -> list:
    import paged_attention as pa
    us = pa.graphed_us
    rows = []
    for model, (B, S) in itertools.product(models, CELLS):
        H, K, D = pa.MODELS[model]
        q, k_cache, v_cache, tables, lens, out, scale, ref = pa.decode_case(model, B, S)
        lib_splits = kernels.decode_num_splits(q, k_cache, tables)
        row = {"model": model, "batch": B, "context": S, "library_splits": lib_splits, "us": {}, "max_abs_error": {},
               "failed": {}}
        runs = {"library": lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, out=out)}
        all_splits = {lib_splits}
        for tile in VARIANTS[D]:
            ws_decode(q, k_cache, v_cache, tables, lens, scale, out, 1, tile)  # compiles it: its residency
            wave = max(1, round(resident(tile, D) * kernels._num_sms(q.device) / (B * K)))  # splits for one wave
            for splits in sorted({lib_splits, wave, 2 * wave}):
                if splits > 1 and S // splits < tile[0]: continue
                all_splits.add(splits)
                runs[f"ws/{tile_name(tile)}/{splits} splits"] = lambda tile=tile, splits=splits: ws_decode(
                    q, k_cache, v_cache, tables, lens, scale, out, splits, tile)
                if bound and not tile[4]:
                    runs[f"bound/{tile_name(tile)}/{splits} splits"] = lambda tile=tile, splits=splits: ws_decode(
                        q, k_cache, v_cache, tables, lens, scale, out, splits, tile, bound=True)
        for splits in sorted(all_splits - {lib_splits}):  # chapter 9's kernel at the same split counts
            runs[f"library/{splits} splits"] = lambda splits=splits: paged_decode_attention(
                q, k_cache, v_cache, tables, lens, scale, splits, out)
        runs["library again"] = runs["library"]
        pa.time_designs(runs, out, ref, row, log)
        k4, v4 = pa.contiguous_kv(k_cache, tables, S), pa.contiguous_kv(v_cache, tables, S)
        del k_cache, v_cache
        row["sdpa_us"] = min(us(pa.sdpa_call(q[:, :, None], k4, v4, scale, pa.sdpa_backends()[n])) for n in ("default", "cudnn"))
        del k4, v4
        torch.cuda.empty_cache()
        row["sdpa_time_over_ours"] = {n: round(row["sdpa_us"] / t, 3) for n, t in row["us"].items()}
        attention = {n: r for n, r in row["sdpa_time_over_ours"].items()
                     if not n.startswith("bound") and row["max_abs_error"][n] < TOLERANCE}
        best = max(attention, key=attention.get)
        log(f"{model} B={B} S={S}: SDPA {row['sdpa_us']} us, library {row['us'].get('library')} us, "
            f"best {best} {row['us'][best]} us ({attention[best]})")
        rows.append(row)
    return rows


def compiled(tile, head_dim: int, group: int, bound: bool = False) -> dict:
    "What _ws_decode_kernel compiles to for sm_90 with this tile (no GPU needed): TMA copies, mma.sync, register hand-offs."
    import re
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    block_n, stages, maxnreg, warps, per_warp = tile
    layout = gl.NVMMASharedLayout.get_default_for([16, head_dim], gl.bfloat16)
    desc = f"tensordesc<bf16[16,{head_dim}],{layout!r}>"
    fn = _ws_decode_kernel
    constexprs = dict(H=8 * group, G=group, K=8, D=head_dim, BLOCK_G=16, BLOCK_SIZE=16, BLOCK_N=block_n, STAGES=stages,
                      SPLIT=True, NUM_WARPS=warps, LOAD_REGS=40, BOUND=bound, PER_WARP=per_warp and not bound)
    types = {"q_ptr": "*bf16", "k_desc": desc, "v_desc": desc, "bt_ptr": "*i32", "lens_ptr": "*i32", "out_ptr": "*bf16",
             "part_out_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "qk_scale": "fp32"}
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if name.endswith("_ptr") or name in ("stride_qb", "stride_qh", "stride_ob", "stride_oh")}
    kernel = triton.compile(GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, maxnreg=maxnreg))
    ptx = kernel.asm["ptx"]
    return {"tma_copies": ptx.count("cp.async.bulk.tensor"), "mma_sync": ptx.count("mma.sync"),
            "setmaxnreg": sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
            "shared_bytes": kernel.metadata.shared}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--models", nargs="+", default=["Llama-3.2-1B", "Qwen3-0.6B"])
    ap.add_argument("--bound", action="store_true", help="also time the load warp alone (the attention warps only free tiles)")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--compile", action="store_true", help="print what each variant compiles to for sm_90 and exit")
    args = ap.parse_args(argv)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)
    if args.compile:
        print(json.dumps({"triton": triton.__version__, "sm_90": {
            f"D={d} {tile_name(tile)}{' bound' * bound}": compiled(tile, d, 4 if d == 64 else 2, bound)
            for d, tiles in VARIANTS.items() for tile in tiles for bound in (False, True) if not (bound and tile[4])}}, indent=1))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    import paged_attention as pa
    t0 = time.monotonic()
    res = {**pa.run_header("decode_gluon"), "check": check(log)}
    res["check_passed"] = max(res["check"].values()) < TOLERANCE
    if not args.check_only and res["check_passed"]:
        res["rows"] = measure(args.models, args.bound, log)
    res["elapsed_s"] = round(time.monotonic() - t0, 1)
    pa.emit(res, args.out)

if __name__ == "__main__":
    main()
