"""Sweep paged DECODE attention configurations on a CUDA GPU; find the fastest per (shape, batch, context) vs torch SDPA.

Issue 4 asks the paged decode kernel to be never slower than torch's scaled_dot_product_attention on contiguous K/V at
batch >= 8, for the KV shapes of Llama-3.2-1B (32 query heads, 8 KV heads of 64) and Qwen3-0.6B (16 query heads, 8 KV
heads of 128), bf16, cache blocks of 16, contexts 512/4096/16384, batch 8/64/256. This script measures, per
(shape, batch, context):

  baseline  nanoserve.kernels.paged_decode_attention with its default heuristics, on the head-major cache that
            PagedKVCache uses since commit 36c4d6d (results/decode_sweep_h100.json predates it: its baseline ran on std);
  std/...   this script's own kernel on the same layout, sweeping BLOCK_N x num_warps x num_stages at the default
            split heuristic, then num_splits in (1, 2, 4) at the best tiles;
  hm/...    the same kernel on a head-major cache (blocks, K, 16, D): each (block, KV head) tile one contiguous run;
  hf/...    the std cache with the grid in the order (KV head, sequence, split): the programs of one sequence's KV
            heads start side by side and read each cache block at about the same time (hmhf: the same, head-major);
  .../F     the split reduction fused into the decode kernel: the last program of a (sequence, KV head) to finish,
            found with an atomic counter, combines the partial results (no second launch);
  SDPA      torch.nn.functional.scaled_dot_product_attention (enable_gqa=True) on the same data laid out
            contiguously [B, K, S, D], best of its backends.

Variant names read LAYOUT/nBLOCK_N wWARPS sSTAGES/spSPLITS[F], e.g. hm/n64w4s2/sp2F.

Every time is the median of triton.testing.do_bench over CUDA-graph replays (as benchmarks/paged_attention.py);
do_bench zeroes a 256 MB buffer before each call, so L2 holds none of the inputs. The sweep ("screen") uses a short
do_bench (--screen-warmup/--screen-rep, scaled up with the kernel's time); the best few of each configuration, the
baseline and SDPA are then timed with the full do_bench (warmup 25 ms, rep 100 ms) and the best is picked from those.
Before a kernel configuration is timed it is checked against a float32 reference on a ragged batch (contexts 1 ..
4097, max abs error <= 0.02 in bf16); on the timing data each variant is also compared with SDPA's output. A variant
that fails to compile, to launch (e.g. out of shared memory) or to check is reported and skipped.

    python benchmarks/decode_sweep.py --out decode_sweep.json                  # the whole sweep, < 5 min on an H100
    python benchmarks/decode_sweep.py --models Qwen3-0.6B --batches 8 --contexts 512
    TRITON_INTERPRET=1 python benchmarks/decode_sweep.py --cpu-check           # correctness only, on the CPU (float32)

Progress goes to stderr; the table goes last to stdout.
"""
import time

T0 = time.monotonic()

import argparse, datetime, inspect, itertools, json, math, os, statistics, sys, traceback
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, wait
from pathlib import Path

if "--cpu-check" in sys.argv:  # the interpreter must be on before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
try:
    import nanoserve  # noqa: F401
except ImportError:  # not installed: run from the checkout
    sys.path.insert(0, str(ROOT))
import triton
import triton.language as tl

import nanoserve.kernels as kernels
from nanoserve.kernels import choose_num_splits, paged_decode_attention

DEVICE = "cuda"
MODELS = {"Llama-3.2-1B": (32, 8, 64), "Qwen3-0.6B": (16, 8, 128)}  # H, K, D
BATCHES, CONTEXTS = (8, 64, 256), (512, 4096, 16384)
BLOCK_SIZE = 16
BLOCKS_N, NUM_WARPS, NUM_STAGES = (16, 32, 64, 128), (2, 4, 8), (1, 2, 3, 4)  # the default sweep
TILES = list(itertools.product(BLOCKS_N, NUM_WARPS, NUM_STAGES))  # (BLOCK_N, num_warps, num_stages)
SPLITS = (1, 2, 4)  # swept at the best tiles, besides the default heuristic
# (blocks, block_size, K, D) and head-major (blocks, K, block_size, D); "hf"/"hmhf": the same caches, the KV heads of one
# sequence launched side by side (grid (K, B, splits) instead of (B, K, splits)), so they read each block together
LAYOUTS = ("std", "hm", "hf", "hmhf")
TOL = 2e-2
CHECK_LENS = [1, 15, 16, 17, 100, 1000, 2047, 4097]  # the ragged batch every kernel configuration is checked on
CHECK_SPLITS = 7  # splits of the split checks: some splits of the short contexts are empty
CPU_MODELS = {"tiny-G4": (8, 2, 16), "tiny-G2": (4, 2, 32)}  # --cpu-check shapes (H, K, D)
CPU_LENS = [1, 15, 16, 17, 40, 100]
FULL_WARMUP, FULL_REP = 25, 100  # ms, as benchmarks/paged_attention.py
TOP_TILES = 2  # tiles per layout whose splits (and fused reduction) are swept
FINAL_TOP = 4  # screened variants re-timed with the full do_bench


def log(*args):
    print(f"[{time.monotonic() - T0:6.1f}s]", *args, file=sys.stderr, flush=True)


def short(e: BaseException) -> str:
    lines = [l for l in str(e).strip().splitlines() if l.strip()]
    return f"{type(e).__name__}: {(lines[-1] if lines else '')[:160]}"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ----------------------------------------------------------------------------------------------------------------------
# Kernels. The algorithm is nanoserve.kernels' decode kernel: one program per (sequence, KV head, split) holds the
# G query heads of its KV head as the rows of a tl.dot (padded to 16), walks its share of the context in tiles of
# BLOCK_N positions gathered through the block table, and keeps an online softmax in base 2. The cache layout is given
# by strides only, so one compiled kernel serves both layouts. num_splits is a runtime argument (not specialized), so
# splits 1, 2, 4, 9, ... share one compiled kernel too.
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit
def _combine_store(out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, b, kh, stride_ob, stride_oh, num_splits,
                   H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, GR: tl.constexpr, BLOCK_D: tl.constexpr,
                   MAX_SPLITS: tl.constexpr):
    "Combine the num_splits partial (m, l, acc) of the G heads of KV head kh of sequence b; store their outputs."
    offs_g, offs_s, offs_d = tl.arange(0, GR), tl.arange(0, MAX_SPLITS), tl.arange(0, BLOCK_D)
    heads = kh * G + offs_g
    g_mask, d_mask = offs_g < G, offs_d < D
    gs_mask = g_mask[:, None] & (offs_s < num_splits)[None, :]  # (GR, S)
    part = (b * H + heads)[:, None] * num_splits + offs_s[None, :]  # (GR, S)
    m = tl.load(part_m_ptr + part, mask=gs_mask, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(part_l_ptr + part, mask=gs_mask, other=0.0, cache_modifier=".cg")
    a = tl.load(part_out_ptr + part[:, :, None] * D + offs_d[None, None, :],
                mask=gs_mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")  # (GR, S, D)
    m_max = tl.max(m, 1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # all splits empty: weights 0, output 0
    w = tl.exp2(m - m_max[:, None])  # (GR, S)
    den = tl.sum(w * l, 1)
    out = tl.sum(w[:, :, None] * a, 1) / tl.where(den == 0.0, 1.0, den)[:, None]  # (GR, D)
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_splits", 19])  # by name and by position (19), whichever this Triton reads
def _sweep_decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, part_out_ptr, part_m_ptr, part_l_ptr,
                         count_ptr, qk_scale, stride_qb, stride_qh, stride_ob, stride_oh, stride_cb, stride_cs,
                         stride_ch, stride_bt, num_splits,
                         H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_D: tl.constexpr, GR: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_N: tl.constexpr, FUSED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                         HEADS_FAST: tl.constexpr):
    if HEADS_FAST:  # grid (K, B, splits): a sequence's KV heads are neighbours in launch order
        kh, b = tl.program_id(0), tl.program_id(1)
    else:
        b, kh = tl.program_id(0), tl.program_id(1)
    split = tl.program_id(2)
    S = tl.load(lens_ptr + b)
    split_len = ((S + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # whole tiles
    start = split * split_len
    end = tl.minimum(start + split_len, S)
    offs_g, offs_d, offs_n = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
    heads = kh * G + offs_g  # rows past G are padding for tl.dot
    g_mask, d_mask = offs_g < G, offs_d < D
    gd_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gd_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    head_off = kh * stride_ch
    for n0 in range(start, end, BLOCK_N):
        n = n0 + offs_n
        n_mask = n < end
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)  # (N,) physical blocks
        rows = blk * stride_cb + (n % BLOCK_SIZE) * stride_cs + head_off  # (N,) where each position's head starts
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # (N, D)
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (G, N), log2 units
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if num_splits == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gd_mask)
    else:
        part = (b * H + heads) * num_splits + split  # partials (B, H, splits[, D])
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(part_out_ptr + part[:, None] * D + offs_d[None, :], acc, mask=gd_mask)
        if FUSED:  # the last program of (b, kh) to finish combines the splits; it resets the counter for the next call
            tl.debug_barrier()  # all of this program's partial stores before its release
            counter = count_ptr + b * (H // G) + kh
            done = tl.atomic_add(counter, 1, sem="acq_rel")
            if done == num_splits - 1:
                _combine_store(out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, b, kh, stride_ob, stride_oh, num_splits,
                               H, G, D, GR, BLOCK_D, MAX_SPLITS)
                tl.atomic_xchg(counter, 0)


@triton.jit(do_not_specialize=["num_splits", 6])
def _sweep_reduce_kernel(out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, stride_ob, stride_oh, num_splits,
                         H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, GR: tl.constexpr, BLOCK_D: tl.constexpr,
                         MAX_SPLITS: tl.constexpr):
    _combine_store(out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, tl.program_id(0), tl.program_id(1), stride_ob,
                   stride_oh, num_splits, H, G, D, GR, BLOCK_D, MAX_SPLITS)


assert list(inspect.signature(_sweep_decode_kernel.fn).parameters)[19] == "num_splits"
assert list(inspect.signature(_sweep_reduce_kernel.fn).parameters)[6] == "num_splits"


class Workspace:
    "Partial results and fused-reduction counters of one batch, allocated once (outside CUDA graphs)."
    def __init__(self, B, H, K, D, max_splits, device):
        self.max_splits = max_splits
        self.part_out = torch.empty(B * H * max_splits * D, dtype=torch.float32, device=device)
        self.part_m = torch.empty(B * H * max_splits, dtype=torch.float32, device=device)
        self.part_l = torch.empty_like(self.part_m)
        self.count = torch.zeros(B * K, dtype=torch.int32, device=device)  # the last program of each resets its own


def _max_splits_constexpr(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def decode_launch(q, k_cache, v_cache, bt, lens, scale, out, ws, block_n, warps, stages, splits, fused,
                  heads_fast=False):
    "(kernel, grid, args, constexprs) of the decode kernel; k_cache/v_cache are (blocks, bs, K, D) views of any strides."
    B, H, D = q.shape
    _, bs, K, _ = k_cache.shape
    G = H // K
    if splits > ws.max_splits:
        raise ValueError(f"splits={splits} > workspace {ws.max_splits}")
    args = (q, k_cache, v_cache, bt, lens, out, ws.part_out, ws.part_m, ws.part_l, ws.count,
            scale * math.log2(math.e), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), bt.stride(0), splits)
    const = dict(H=H, G=G, D=D, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_D=triton.next_power_of_2(D),
                 GR=max(2, triton.next_power_of_2(G)), MAX_SPLITS=_max_splits_constexpr(ws.max_splits),
                 BLOCK_SIZE=bs, BLOCK_N=block_n, FUSED=bool(fused), UPCAST=interpreting(),
                 PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HEADS_FAST=bool(heads_fast),
                 num_warps=warps, num_stages=stages)
    return ((K, B, splits) if heads_fast else (B, K, splits)), args, const


def reduce_launch(out, K, ws, splits):
    "(grid, args, constexprs) of the split reduction kernel: one program per (sequence, KV head)."
    B, H, D = out.shape
    G = H // K
    args = (out, ws.part_out, ws.part_m, ws.part_l, out.stride(0), out.stride(1), splits)
    const = dict(H=H, G=G, D=D, GR=max(2, triton.next_power_of_2(G)), BLOCK_D=triton.next_power_of_2(D),
                 MAX_SPLITS=_max_splits_constexpr(ws.max_splits), num_warps=4)
    return (B, K), args, const


def sweep_decode(q, k_cache, v_cache, bt, lens, scale, out, ws, block_n, warps, stages, splits, fused=False,
                 heads_fast=False):
    "Run this script's decode kernel (and its reduction unless fused or unsplit); returns out (B, H, D)."
    grid, args, const = decode_launch(q, k_cache, v_cache, bt, lens, scale, out, ws, block_n, warps, stages, splits,
                                      fused, heads_fast)
    _sweep_decode_kernel[grid](*args, **const)
    if splits > 1 and not fused:
        grid, args, const = reduce_launch(out, k_cache.shape[2], ws, splits)
        _sweep_reduce_kernel[grid](*args, **const)
    return out


def _precompile_worker(jobs, device=None):
    "In a spawned process: compile [(model, (BLOCK_N, warps, stages, fused, heads_fast) or 'reduce')] into Triton's disk cache."
    data, done, device = {}, [], device or DEVICE
    for model, job in jobs:
        t = time.monotonic()
        try:
            if model not in data:  # the check batch: the same argument specializations as the check and the timing
                data[model] = ragged_inputs(*MODELS[model], CHECK_LENS, torch.bfloat16, device, with_ref=False)
            d = data[model]
            if job == "reduce":
                kernel = _sweep_reduce_kernel
                grid, args, const = reduce_launch(d["out"], MODELS[model][1], d["ws"], CHECK_SPLITS)
            else:
                n, w, s, fused, heads_fast = job
                kernel, (kc, vc) = _sweep_decode_kernel, d["caches"]["std"]
                grid, args, const = decode_launch(d["q"], kc, vc, d["bt"], d["lens"], d["scale"], d["out"], d["ws"],
                                                  n, w, s, CHECK_SPLITS, fused, heads_fast)
            try:
                kernel.warmup(*args, grid=grid, **const)  # compile only
            except (TypeError, AttributeError):  # a Triton without this warmup API: compile by launching one program
                kernel[(1,) * len(grid)](*args, **const)
            done.append((model, job, None, time.monotonic() - t))
        except Exception as e:
            done.append((model, job, short(e), time.monotonic() - t))
    return done


def cache_of(layout: str) -> str:
    "Which cache a layout name reads: 'hm' (head-major) or 'std'."
    return "hm" if layout.startswith("hm") else "std"


def head_major(cache: torch.Tensor) -> torch.Tensor:
    "A (blocks, bs, K, D) cache copied to head-major memory (blocks, K, bs, D), returned as a (blocks, bs, K, D) view."
    return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


class Variant:
    "One configuration of this script's kernel (or the baseline)."
    def __init__(self, layout, block_n, warps, stages, splits, fused=False):
        self.layout, self.tile, self.splits, self.fused = layout, (block_n, warps, stages), splits, fused

    @property
    def name(self):
        if self.layout == "baseline": return "baseline" if self.splits is None else f"baseline/sp{self.splits}"
        n, w, s = self.tile
        return f"{self.layout}/n{n}w{w}s{s}/sp{self.splits}{'F' if self.fused else ''}"

    @property
    def family(self):
        return "baseline" if self.layout == "baseline" else self.layout + ("+fused" if self.fused else "")

    def fn(self, data):
        "A no-argument callable running this variant on `data` (a dict of inputs, caches by layout, out, ws)."
        q, bt, lens, scale, out = data["q"], data["bt"], data["lens"], data["scale"], data["out"]
        if self.layout == "baseline":
            kc, vc = data["caches"]["hm"]  # the engine's layout
            return lambda: paged_decode_attention(q, kc, vc, bt, lens, scale, num_splits=self.splits, out=out)
        kc, vc = data["caches"][cache_of(self.layout)]
        n, w, s = self.tile
        ws, splits, fused, heads_fast = data["ws"], self.splits, self.fused, self.layout.endswith("hf")
        return lambda: sweep_decode(q, kc, vc, bt, lens, scale, out, ws, n, w, s, splits, fused, heads_fast)


# ----------------------------------------------------------------------------------------------------------------------
# Reference and checks
# ----------------------------------------------------------------------------------------------------------------------
def reference_fp32(q, k_cache, v_cache, bt, lens, scale) -> torch.Tensor:
    "Float32 attention of each sequence's query over its context, gathered through its block table: (B, H, D)."
    B, H, D = q.shape
    _, bs, K, _ = k_cache.shape
    out = torch.empty(B, H, D, dtype=torch.float32, device=q.device)
    for b, S in enumerate(lens.tolist()):
        blocks = bt[b, :triton.cdiv(S, bs)].long()
        k = k_cache[blocks].flatten(0, 1)[:S].float().repeat_interleave(H // K, dim=1)  # (S, H, D)
        v = v_cache[blocks].flatten(0, 1)[:S].float().repeat_interleave(H // K, dim=1)
        p = torch.softmax(torch.einsum("hd,shd->hs", q[b].float(), k) * scale, dim=-1)
        out[b] = torch.einsum("hs,shd->hd", p, v)
    return out


def ragged_inputs(H, K, D, lens, dtype, device, seed=1, with_ref=True):
    "A ragged check batch: caches (std and head-major), scattered blocks, tables padded with -1 to a multiple of 16."
    g = torch.Generator().manual_seed(seed)
    nb = [triton.cdiv(S, BLOCK_SIZE) for S in lens]
    perm = torch.randperm(sum(nb), generator=g).tolist()
    tables = [perm[sum(nb[:i]):sum(nb[:i + 1])] for i in range(len(lens))]
    width = triton.cdiv(max(nb), 16) * 16  # the timing tables' widths are multiples of 16: one specialization for both
    i32 = dict(dtype=torch.int32, device=device)
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], **i32)
    k_cache = torch.randn(sum(nb), BLOCK_SIZE, K, D, generator=g).to(dtype).to(device)
    v_cache = torch.randn(sum(nb), BLOCK_SIZE, K, D, generator=g).to(dtype).to(device)
    q = torch.randn(len(lens), H, D, generator=g).to(dtype).to(device)
    lens_t = torch.tensor(lens, **i32)
    scale = D**-0.5
    data = dict(q=q, bt=bt, lens=lens_t, scale=scale, out=torch.empty_like(q),
                caches={"std": (k_cache, v_cache), "hm": (head_major(k_cache), head_major(v_cache))},
                ws=Workspace(len(lens), H, K, D, 16, device))
    if with_ref:
        data["ref"] = reference_fp32(q, k_cache, v_cache, bt, lens_t, scale)
    return data


def check_variant(v: Variant, data) -> float:
    "Max abs error of variant v on the ragged batch against the float32 reference (NaN counts as infinite)."
    for t in (data["out"], data["ws"].part_out, data["ws"].part_m, data["ws"].part_l):
        t.fill_(float("nan"))  # nothing left over from an earlier variant can pass for a result
    v.fn(data)()
    err = (data["out"].float() - data["ref"]).abs().max().item()
    return float("inf") if math.isnan(err) else err


def check_variants(variants, data, results: dict, label="") -> list:
    "Check each variant; record its error or failure in `results`; return those that passed."
    ok = []
    for v in variants:
        key = f"{label}{v.name}"
        try:
            err = check_variant(v, data)
        except Exception as e:  # compile error, out of resources, ...
            results[key] = short(e)
            log(f"  {key}: FAILED {short(e)}")
            continue
        results[key] = err
        if err <= TOL:
            ok.append(v)
        else:
            log(f"  {key}: WRONG, max abs err {err:.3g} > {TOL}")
    return ok


def tile_check_variants(tile, layouts=LAYOUTS, fused=True):
    "The variants that exercise every path of one compiled tile: unsplit, split + reduce, split + fused reduction."
    n, w, s = tile
    vs = []
    for layout in layouts:
        vs += [Variant(layout, n, w, s, 1), Variant(layout, n, w, s, CHECK_SPLITS)]
        if fused:
            vs.append(Variant(layout, n, w, s, CHECK_SPLITS, fused=True))
    return vs


def cpu_check(args) -> int:
    "Every variant's correctness check at tiny shapes in float32 on the CPU (Triton interpreter)."
    if not interpreting():
        sys.exit("--cpu-check needs TRITON_INTERPRET=1 set before triton is imported")
    tiles = TILES if args.cpu_all_tiles else sorted({(n, 4, 2) for n, _, _ in TILES})
    log(f"CPU check (interpreter, float32): {len(CPU_MODELS)} shapes x {len(tiles)} tiles x layouts {LAYOUTS} x "
        f"(splits 1, {CHECK_SPLITS}, {CHECK_SPLITS} fused) + baseline; contexts {CPU_LENS}")
    if not args.cpu_all_tiles:
        log("  (num_warps/num_stages do not change what the interpreter computes: one per BLOCK_N; --cpu-all-tiles "
            "runs all 48)")
    results, failed = {}, []
    for model, (H, K, D) in CPU_MODELS.items():
        t = time.monotonic()
        data = ragged_inputs(H, K, D, CPU_LENS, torch.float32, "cpu")
        heur = choose_num_splits(len(CPU_LENS), K, data["bt"].shape[1] * BLOCK_SIZE)
        variants = [Variant("baseline", 0, 0, 0, s) for s in (None, 1, CHECK_SPLITS)]
        for tile in tiles:
            variants += tile_check_variants(tile)
        # the heuristic split count and the sweep's splits as well, for one tile per layout
        variants += [Variant(layout, 32, 4, 2, s, f) for layout in LAYOUTS for s in sorted({2, 4, max(2, heur)})
                     for f in (False, True)]
        res = {}
        passed = check_variants(variants, data, res, label=f"{model} ")
        for key, err in res.items():
            results[key] = err
            if not (isinstance(err, float) and err <= TOL):
                failed.append(key)
        worst = max(e for e in res.values() if isinstance(e, float))
        log(f"{model} (H={H}, K={K}, D={D}): {len(passed)}/{len(variants)} variants pass, worst max abs err "
            f"{worst:.2e}, {time.monotonic() - t:.1f}s")
    # empty contexts and a fused counter left clean for the next call: run the fused variant twice on one batch
    data = ragged_inputs(8, 2, 16, [0, 1, 37], torch.float32, "cpu", seed=3)
    for v in (Variant("std", 16, 4, 2, 3, fused=True), Variant("hm", 32, 4, 2, 3, fused=True),
              Variant("hf", 16, 4, 2, 3, fused=True), Variant("hmhf", 32, 4, 2, 3, fused=True)):
        errs = [check_variant(v, data) for _ in range(2)]
        clean = int(data["ws"].count.abs().sum()) == 0
        key = f"zero-length contexts, twice: {v.name}"
        results[key] = max(errs)
        if not (max(errs) <= TOL and clean):
            failed.append(key)
        log(f"{key}: max abs err {max(errs):.2e}, counters reset: {clean}")
    n_ok = len(results) - len(failed)
    print(f"CPU check: {n_ok}/{len(results)} variant checks passed (tolerance {TOL}, float32, TRITON_INTERPRET=1)")
    for key in failed:
        print(f"  FAILED {key}: {results[key]}")
    print("PASS" if not failed else "FAIL")
    return 0 if not failed else 1


# ----------------------------------------------------------------------------------------------------------------------
# Timing (GPU)
# ----------------------------------------------------------------------------------------------------------------------
_SIDE_STREAM = []


def graphed(fn):
    "`fn` captured once in a CUDA graph; replaying it times the GPU work without Python's launch overhead."
    if not _SIDE_STREAM:
        _SIDE_STREAM.append(torch.cuda.Stream())
    side = _SIDE_STREAM[0]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm up (compile, pick kernels) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def bench_ms(fn, warmup, rep) -> float:
    "Median ms of do_bench over CUDA-graph replays of fn (do_bench flushes L2 before each replay)."
    graph = graphed(fn)
    times = triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="all")
    torch.cuda.synchronize()
    del graph
    return statistics.median(times)


def contiguous_kv(cache, block_tables, S, chunk=8):
    "The cache of each sequence as one contiguous [B, K, S, D] tensor, gathered a few sequences at a time."
    B, (_, bs, K, D) = block_tables.shape[0], cache.shape
    out = torch.empty(B, K, S, D, dtype=cache.dtype, device=cache.device)
    for i in range(0, B, chunk):
        out[i:i + chunk] = cache[block_tables[i:i + chunk].long()].flatten(1, 2)[:, :S].transpose(1, 2)
    return out


def sdpa_backends():
    from torch.nn.attention import SDPBackend
    return {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}


def sdpa_call(q4, k4, v4, scale, backend):
    from torch.nn.attention import sdpa_kernel
    def run():
        if backend is None:
            return F.scaled_dot_product_attention(q4, k4, v4, scale=scale, enable_gqa=True)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q4, k4, v4, scale=scale, enable_gqa=True)
    return run


def free_bytes() -> int:
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


class Sweep:
    def __init__(self, args):
        self.args = args
        self.deadline = T0 + args.budget_s
        self.num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.checks = {}  # "model variant" -> max abs err or failure
        self.failed = {}  # "model variant" -> why it was dropped
        self.ok_tiles = {}  # model -> tiles whose std/hm unsplit + split checks passed
        self.fused_ok = {}  # (model, tile) -> bool, checked lazily
        self.check_data = {}
        self.n_timings = {"screen": 0, "full": 0}
        self.tiles = list(itertools.product(args.block_n or BLOCKS_N, args.num_warps, args.num_stages))
        self.layouts = tuple(args.layouts)
        self.rows = []

    def over_budget(self) -> bool:
        return time.monotonic() > self.deadline

    # -- compile and check ---------------------------------------------------------------------------------------------
    def precompile(self, models):
        "Compile every kernel of the sweep in parallel worker processes into Triton's disk cache (first use loads it)."
        fused = (False,) if self.args.no_fused else (False, True)
        orders = sorted({layout.endswith("hf") for layout in self.layouts})
        jobs = [(m, (n, w, s, f, hf)) for f in fused for hf in orders for m in models for n, w, s in self.tiles]
        jobs += [(m, "reduce") for m in models]
        workers = min(self.args.compile_workers, len(jobs))
        if workers < 1:
            return
        t = time.monotonic()
        log(f"compiling {len(jobs)} kernels in {workers} worker processes ...")
        chunks = [jobs[i::workers] for i in range(workers)]
        ex = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
        try:
            futures = [ex.submit(_precompile_worker, c) for c in chunks]
            done, pending = wait(futures, timeout=self.args.compile_timeout_s)
            results = [r for f in done if f.exception() is None for r in f.result()]
            for f in done:
                if f.exception() is not None:
                    log(f"  a compile worker failed: {short(f.exception())}")
            errors = [(m, j, e) for m, j, e, _ in results if e]
            for m, j, e in errors[:10]:
                log(f"  {m} {j}: {e}")
            log(f"  {len(results) - len(errors)}/{len(jobs)} compiled, {len(errors)} failed, "
                f"{len(pending)} workers unfinished, in {time.monotonic() - t:.1f}s (compile time "
                f"{sum(r[3] for r in results):.0f}s in all)")
            if pending:  # stop them: they would compete with the timing for the CPU
                for proc in list(getattr(ex, "_processes", {}).values()):
                    proc.terminate()
        except Exception as e:
            log(f"  parallel compile failed ({short(e)}): kernels compile on first use")
        finally:
            ex.shutdown(wait=False, cancel_futures=True)

    def prepare_model(self, model):
        H, K, D = MODELS[model]
        log(f"{model}: checking kernels on a ragged batch {CHECK_LENS} (bf16, float32 reference) ...")
        data = ragged_inputs(H, K, D, CHECK_LENS, torch.bfloat16, DEVICE)
        self.check_data[model] = data
        t = time.monotonic()
        res = {}
        check_variants([Variant("baseline", 0, 0, 0, s) for s in (None, 1, CHECK_SPLITS)], data, res)
        ok_tiles = []
        for tile in self.tiles:
            vs = tile_check_variants(tile, self.layouts, fused=False)
            passed = check_variants(vs, data, res)
            if len(passed) == len(vs):
                ok_tiles.append(tile)
            else:
                self.failed[f"{model} tile n{tile[0]}w{tile[1]}s{tile[2]}"] = "; ".join(
                    f"{v.name}: {res[v.name]}" for v in vs if v not in passed)
        self.checks.update({f"{model} {k}": v for k, v in res.items()})
        self.ok_tiles[model] = ok_tiles
        log(f"  {len(ok_tiles)}/{len(self.tiles)} tiles compile and pass ({time.monotonic() - t:.1f}s); "
            f"worst error {max((e for e in res.values() if isinstance(e, float)), default=float('nan')):.2e}")

    def fused_tile_ok(self, model, tile) -> bool:
        key = (model, tile)
        if key not in self.fused_ok:
            res = {}
            vs = [Variant(layout, *tile, CHECK_SPLITS, fused=True) for layout in self.layouts]
            passed = check_variants(vs, self.check_data[model], res)
            self.checks.update({f"{model} {k}": v for k, v in res.items()})
            self.fused_ok[key] = len(passed) == len(vs)
            if not self.fused_ok[key]:
                self.failed[f"{model} fused n{tile[0]}w{tile[1]}s{tile[2]}"] = "; ".join(f"{k}: {v}" for k, v in res.items())
        return self.fused_ok[key]

    # -- one configuration ---------------------------------------------------------------------------------------------
    def time_variant(self, v, data, row, full=False):
        "Check v's output on the timing data against SDPA's, then time it; None if it fails."
        warmup, rep = (FULL_WARMUP, FULL_REP) if full else data["screen"]
        try:
            fn = v.fn(data)
            data["out"].fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = (data["out"].float() - data["sdpa_out"]).abs().max().item()
            tol = min(TOL, 0.1 * data["sdpa_max"] + 1e-3)  # outputs of long random contexts are small
            if not err <= tol:
                raise ValueError(f"differs from SDPA by {err:.3g} > {tol:.3g}")
            ms = bench_ms(fn, warmup, rep)
        except Exception as e:
            row["dropped"][v.name] = short(e)
            log(f"    {v.name}: dropped, {short(e)}")
            torch.cuda.synchronize()
            return None
        self.n_timings["full" if full else "screen"] += 1
        (row["full_ms"] if full else row["screen_ms"])[v.name] = ms
        return ms

    def run_config(self, model, B, S):
        H, K, D = MODELS[model]
        nb = S // BLOCK_SIZE
        row = dict(model=model, num_heads=H, num_kv_heads=K, head_dim=D, batch=B, context=S, block_size=BLOCK_SIZE,
                   screen_ms={}, full_ms={}, dropped={})
        cache_bytes = 2 * B * S * K * D * 2
        if 2 * cache_bytes + (2 << 30) > free_bytes():
            row["skipped"] = f"needs {2 * cache_bytes / 2**30:.1f} GiB for two copies of the KV cache"
            log(f"{model} B={B} S={S}: skipped, {row['skipped']}")
            return row
        t_start = time.monotonic()
        torch.manual_seed(0)
        k_cache = torch.randn(B * nb, BLOCK_SIZE, K, D, dtype=torch.bfloat16, device=DEVICE)
        v_cache = torch.randn_like(k_cache)
        bt = torch.randperm(B * nb, device=DEVICE).view(B, nb).int()
        lens = torch.full((B,), S, dtype=torch.int32, device=DEVICE)
        q = torch.randn(B, H, D, dtype=torch.bfloat16, device=DEVICE)
        scale = D**-0.5
        heur = choose_num_splits(B, K, nb * BLOCK_SIZE, self.num_sms)
        row["heuristic_splits"] = heur
        # SDPA on contiguous copies (also the sanity reference on the timing data)
        k4, v4 = contiguous_kv(k_cache, bt, S), contiguous_kv(v_cache, bt, S)
        q4 = q[:, :, None]
        sdpa_out = F.scaled_dot_product_attention(q4, k4, v4, scale=scale, enable_gqa=True)[:, :, 0].float()
        by_backend = {}
        for name, backend in sdpa_backends().items():
            fn = sdpa_call(q4, k4, v4, scale, backend)
            try:
                fn()
                torch.cuda.synchronize()
                by_backend[name] = bench_ms(fn, FULL_WARMUP, FULL_REP)
                self.n_timings["full"] += 1
            except Exception as e:  # the backend refuses these inputs, or no memory
                by_backend[name] = None
                log(f"    sdpa {name}: {short(e)}")
                torch.cuda.synchronize()
        del k4, v4
        ok = {n: ms for n, ms in by_backend.items() if ms is not None}
        row["sdpa_ms_by_backend"] = by_backend
        if ok:
            row["sdpa_backend"] = min(ok, key=ok.get)
            row["sdpa_ms"] = ok[row["sdpa_backend"]]
        est = row.get("sdpa_ms", 0.05)
        screen = (max(self.args.screen_warmup, 1.5 * est), max(self.args.screen_rep, 6 * est))
        max_splits = max(16, heur, max(SPLITS))
        data = dict(q=q, bt=bt, lens=lens, scale=scale, out=torch.empty_like(q), sdpa_out=sdpa_out,
                    sdpa_max=sdpa_out.abs().max().item(), screen=screen,
                    caches={"std": (k_cache, v_cache), "hm": (head_major(k_cache), head_major(v_cache))},  # hm: also the baseline's
                    ws=Workspace(B, H, K, D, max_splits, DEVICE))
        # baseline
        base = Variant("baseline", 0, 0, 0, None)
        self.time_variant(base, data, row, full=True)
        row["baseline_ms"] = row["full_ms"].get("baseline")
        tiles = self.ok_tiles[model]
        screened = {}  # name -> (Variant, ms)

        def screen_one(v):
            if v.name in screened or v.name in row["dropped"]:
                return
            ms = self.time_variant(v, data, row)
            if ms is not None:
                screened[v.name] = (v, ms)

        for layout in self.layouts:
            if self.over_budget():
                log(f"    over budget: screening {layout} with the top tiles of earlier configurations only")
                tl_ = self.favourite_tiles(model, layout)
            else:
                tl_ = tiles
            for tile in tl_:
                screen_one(Variant(layout, *tile, heur))
            # splits at the best tiles of this layout
            ranked = sorted(((v, ms) for v, ms in screened.values()
                             if v.layout == layout and not v.fused and v.splits == heur), key=lambda x: x[1])
            best_tiles = [v.tile for v, _ in ranked[:TOP_TILES]]
            for tile in best_tiles:
                for sp in SPLITS:
                    screen_one(Variant(layout, *tile, sp))
            if not self.args.no_fused:
                for tile in best_tiles:
                    if not self.fused_tile_ok(model, tile):
                        continue
                    for sp in sorted({2, 4, heur}):
                        if sp > 1:
                            screen_one(Variant(layout, *tile, sp, fused=True))
        # final: the best screened variants (and the best of each family) with the full do_bench
        ranked = sorted(screened.values(), key=lambda x: x[1])
        finalists = [v for v, _ in ranked[:FINAL_TOP]]
        for fam in [layout + f for layout in self.layouts for f in ("", "+fused")]:
            fam_best = [v for v, _ in ranked if v.family == fam][:1]
            finalists += [v for v in fam_best if v not in finalists]
        for v in {v.name: v for v in finalists}.values():
            self.time_variant(v, data, row, full=True)
        full = dict(row["full_ms"])  # the baseline competes too
        if full:
            best = min(full, key=full.get)
            row.update(best_variant=best, best_ms=full[best])
        row["best_by_family"] = {}
        for v, ms in ranked:
            fam = row["best_by_family"].setdefault(v.family, dict(variant=v.name, screen_ms=ms))
            if fam["variant"] == v.name and v.name in row["full_ms"]:
                fam["ms"] = row["full_ms"][v.name]
        if "sdpa_ms" in row:
            if row.get("best_ms"):
                row["best_vs_sdpa"] = row["best_ms"] / row["sdpa_ms"]  # time ratio: <= 1 is not slower than SDPA
                row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["best_ms"]
            if row.get("baseline_ms"):
                row["baseline_speedup_vs_sdpa"] = row["sdpa_ms"] / row["baseline_ms"]
        row["screen_rank"] = [[v.name, ms] for v, ms in ranked]
        row["_ranked_variants"] = ranked  # (for favourite_tiles; dropped before the JSON is written)
        row["wall_s"] = time.monotonic() - t_start
        del data, k_cache, v_cache
        log(f"{model:13s} B={B:3d} S={S:5d}: baseline {fmt(row.get('baseline_ms'))}  best {row.get('best_variant')} "
            f"{fmt(row.get('best_ms'))}  SDPA {fmt(row.get('sdpa_ms'))} [{row.get('sdpa_backend')}]  "
            f"x{row.get('speedup_vs_sdpa', float('nan')):.3f}  ({len(row['screen_ms'])} screened, "
            f"{row['wall_s']:.1f}s)")
        return row

    def favourite_tiles(self, model, layout, k=2):
        "The tiles of this layout that ranked highest in earlier configurations of this shape (when time runs short)."
        score = {}
        for r in self.rows:
            if r.get("model") != model: continue
            ranked = [v for v, _ in r.get("_ranked_variants", []) if v.layout == layout]
            for i, v in enumerate(ranked[:3]):
                score[v.tile] = score.get(v.tile, 0) + 3 - i
        ok = self.ok_tiles.get(model, [])
        tiles = [t for t in sorted(score, key=score.get, reverse=True) if t in ok][:k]
        return tiles or [t for t in ((64, 4, 2), (32, 4, 2)) if t in ok][:1] or ok[:1]


def fmt(ms):
    return "   -   " if ms is None else f"{ms:.4f}"


def table(rows) -> str:
    head = (f"{'model':13s} {'B':>3s} {'S':>5s} {'heur':>4s} {'base_ms':>8s} {'best variant':24s} {'best_ms':>8s} "
            f"{'sdpa_ms':>8s} {'best/sdpa':>9s} {'base/sdpa':>9s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['model']:13s} {r['batch']:3d} {r['context']:5d} skipped: {r['skipped']}")
            continue
        ratio = lambda ms: f"{ms / r['sdpa_ms']:9.3f}" if ms and r.get("sdpa_ms") else f"{'-':>9s}"
        lines.append(f"{r['model']:13s} {r['batch']:3d} {r['context']:5d} {r.get('heuristic_splits', 0):4d} "
                     f"{fmt(r.get('baseline_ms')):>8s} {str(r.get('best_variant')):24s} {fmt(r.get('best_ms')):>8s} "
                     f"{fmt(r.get('sdpa_ms')):>8s} {ratio(r.get('best_ms'))} {ratio(r.get('baseline_ms'))}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="write the JSON here")
    p.add_argument("--cpu-check", action="store_true", help="only check every variant at tiny shapes on the CPU "
                   "(TRITON_INTERPRET=1, float32)")
    p.add_argument("--cpu-all-tiles", action="store_true", help="with --cpu-check: all 48 tiles, not one per BLOCK_N")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    p.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    p.add_argument("--block-n", nargs="+", type=int, help="only these BLOCK_N (default 16 32 64 128)")
    p.add_argument("--num-warps", nargs="+", type=int, default=list(NUM_WARPS), help="default %(default)s")
    p.add_argument("--num-stages", nargs="+", type=int, default=list(NUM_STAGES), help="default %(default)s; a load "
                   "whose addresses come from the block table gets (num_stages - 1) // 2 buffers (at least 1 from 2 stages on) from "
                   "Triton's pipeliner, so 5+ is where a tile gets a second")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS),
                   help="cache layouts / grid orders to sweep (default all: %(default)s)")
    p.add_argument("--budget-s", type=float, default=240.0, help="wall-clock budget: past it, later configurations "
                   "screen only the tiles that won earlier ones (default 240)")
    p.add_argument("--screen-warmup", type=float, default=2.0, help="do_bench warmup (ms) of the sweep (default 2)")
    p.add_argument("--screen-rep", type=float, default=10.0, help="do_bench rep (ms) of the sweep (default 10)")
    p.add_argument("--no-fused", action="store_true", help="skip the fused-reduction variants")
    p.add_argument("--compile-workers", type=int, default=max(0, min(14, (os.cpu_count() or 1) - 2)),
                   help="processes that compile the kernels up front (0: compile each on first use; default "
                        "min(14, CPUs - 2))")
    p.add_argument("--compile-timeout-s", type=float, default=150.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cpu_check:
        sys.exit(cpu_check(args))
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --cpu-check under TRITON_INTERPRET=1)")
    if interpreting():
        sys.exit("TRITON_INTERPRET is set: unset it to time on the GPU")
    prop = torch.cuda.get_device_properties(0)
    sw = Sweep(args)
    res = {
        "benchmark": "decode_sweep",
        "device": {"name": torch.cuda.get_device_name(0), "sms": prop.multi_processor_count,
                   "memory_gib": round(prop.total_memory / 2**30, 1)},
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                     "python": sys.version.split()[0]},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"dtype": "bfloat16", "block_size": BLOCK_SIZE, "tiles (BLOCK_N, num_warps, num_stages)": sw.tiles,
                     "splits": list(SPLITS) + ["heuristic"], "layouts": list(sw.layouts), "fused": not args.no_fused,
                     "screen": f"do_bench(warmup=max({args.screen_warmup}, 1.5 x SDPA ms), rep=max({args.screen_rep}, "
                               f"6 x SDPA ms)) median of CUDA-graph replays, L2 flushed",
                     "full": f"do_bench(warmup={FULL_WARMUP}, rep={FULL_REP}) median of CUDA-graph replays, L2 flushed",
                     "top_tiles_per_layout": TOP_TILES, "final_top": FINAL_TOP, "budget_s": args.budget_s,
                     "baseline_constants": {
                         **{c: getattr(kernels, c) for c in (
                             "DECODE_PROGRAMS_PER_SM", "DECODE_MIN_SPLIT_TOKENS", "DECODE_MAX_SPLITS")},
                         "DECODE_TILES": [[str(b) if math.isinf(b) else b, {str(d): list(t) for d, t in tiles.items()}]
                                          for b, tiles in kernels.DECODE_TILES]}},
    }
    configs = [(m, B, S) for m in args.models for B in args.batches for S in args.contexts]
    log(f"{len(configs)} configurations, {len(sw.tiles)} tiles x {len(sw.layouts)} layouts; budget {args.budget_s:.0f}s")
    sw.precompile(args.models)
    for model in args.models:
        try:
            sw.prepare_model(model)
        except Exception as e:
            log(f"{model}: checks failed to run: {short(e)}")
            traceback.print_exc(file=sys.stderr)
            sw.ok_tiles[model] = []
        for B in args.batches:
            for S in args.contexts:
                try:
                    row = sw.run_config(model, B, S)
                except Exception as e:  # keep going: report the configuration as failed
                    log(f"{model} B={B} S={S}: FAILED {short(e)}")
                    traceback.print_exc(file=sys.stderr)
                    row = dict(model=model, batch=B, context=S, skipped=f"error: {short(e)}")
                sw.rows.append(row)
                torch.cuda.empty_cache()
    for r in sw.rows:  # (Variant objects only for favourite_tiles)
        r.pop("_ranked_variants", None)
    goal = [r for r in sw.rows if r.get("batch", 0) >= 8 and "best_vs_sdpa" in r]
    worst = max(goal, key=lambda r: r["best_vs_sdpa"], default=None)
    base = [r["baseline_ms"] / r["sdpa_ms"] for r in sw.rows if r.get("baseline_ms") and r.get("sdpa_ms")]
    res.update(checks=sw.checks, dropped_kernels=sw.failed, configs=sw.rows, timings=sw.n_timings,
               summary={"max_best_vs_sdpa (time ratio)": worst["best_vs_sdpa"] if worst else None,
                        "worst_config": f"{worst['model']} B={worst['batch']} S={worst['context']}" if worst else None,
                        "max_baseline_vs_sdpa (time ratio)": max(base) if base else None,
                        "configs_slower_than_sdpa": [f"{r['model']} B={r['batch']} S={r['context']}" for r in goal
                                                     if r["best_vs_sdpa"] > 1],
                        "goal_met (best never slower than SDPA at B>=8)": bool(goal) and all(
                            r["best_vs_sdpa"] <= 1 for r in goal)},
               elapsed_s=time.monotonic() - T0)
    text = json.dumps(res, indent=1, default=str)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        log(f"wrote {args.out}")
    log(f"{sw.n_timings['screen']} screen + {sw.n_timings['full']} full timings in {res['elapsed_s']:.0f}s")
    print(table(sw.rows))
    s = res["summary"]
    print(f"best/sdpa and base/sdpa are time ratios (<= 1: not slower than SDPA). Worst best/sdpa at B>=8: "
          f"{fmt(s['max_best_vs_sdpa (time ratio)'])} ({s['worst_config']}); worst base/sdpa: "
          f"{fmt(s['max_baseline_vs_sdpa (time ratio)'])}; slower than SDPA: {s['configs_slower_than_sdpa'] or 'none'}; "
          f"{sum(sw.n_timings.values())} timings, {res['elapsed_s']:.0f}s")


if __name__ == "__main__":
    # Run under a stable module name: the compile workers (spawned) import this file as `decode_sweep`, and the kernels'
    # module name is part of Triton's cache key, so this process then finds what they compiled.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import decode_sweep
    decode_sweep.T0 = T0
    decode_sweep.main()
