"""An int8 matmul tried against chapter 9c's tiled kernel at 32 to 256 rows, and not adopted; prints JSON.

From 64 rows chapter 9c's tiled int8 kernel falls behind cuBLAS's bf16 matmul. One suspect is where the weight is
widened: `tl.dot(x, trans(q.to(bf16)))` makes the widened weight the *second* operand, which Hopper's wgmma reads
from shared memory only, so it must go back there after the conversion in registers. This design swaps the operands,
out^T = (q s) x^T, so that the widened weight is the first operand, which wgmma may take from registers.

On an H100 (2026-11-24, benchmarks/results/performance/int8_swap_ab_h100.json) the swap helped q/k/v at 64 to 256
rows (at 256: 14.9 us against 25.4), o and down at 128 and 256 rows by 2 to 13 %, and gate/up never; one decoder layer
at 128 rows would take 79 us with the better of the two kernels for each weight against 88 us, and 62 us in bf16. A second kernel and a
dispatch by shape for about 10 %, still short of bf16, was not worth its lines.

    python benchmarks/int8_swap_ab.py > int8_swap_ab.json      # ~3 min on an H100
    TRITON_INTERPRET=1 python benchmarks/int8_swap_ab.py         # the kernel against the reference, on a CPU

Progress goes to stderr; stdout gets only the JSON.
"""
import json, sys, os
import torch, triton, triton.language as tl
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
from nanoserve.kernels import _dot_precision, _follow_early, _pdl
import nanoserve.quantization as Q

@triton.jit
def _swap_kernel(x_ptr, q_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + rn.to(tl.int64)[:, None] * K
    k = tl.arange(0, BLOCK_K)
    q = tl.load(q_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0)
    _follow_early(PDL)
    x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
    acc = tl.dot(q.to(x.dtype), tl.trans(x), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(q_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0)
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
        acc = tl.dot(q.to(x.dtype), tl.trans(x), acc, input_precision=PRECISION)
    out = acc * tl.load(scale_ptr + rn, mask=n_mask, other=0.0)[:, None]
    tl.store(out_ptr + rm.to(tl.int64)[None, :] * stride_om + rn[:, None], out.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & m_mask[None, :])

def swap_linear(x, q, s, tile):
    M, K = x.shape; N = q.shape[0]
    bm, bn, bk, w, st = tile
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    pdl = _pdl(x.device)
    _swap_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](x, q, s, out, M, N, K, x.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, PRECISION=_dot_precision(x.dtype), num_warps=w, num_stages=st, PDL=pdl, launch_pdl=pdl)
    return out

if __name__ == "__main__":
    if not torch.cuda.is_available():
        q, s = Q.quantize_int8(torch.randn(70, 300)); x = torch.randn(40, 300)
        print((swap_linear(x, q, s, (16, 64, 64, 4, 2)) - x @ Q.dequantize_int8(q, s).T).abs().max()); sys.exit()
    import int8_linear as B  # its Weight copies and per-call timer
    SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
    TILES = [(bm, bn, bk, w, st) for bm in (16, 32, 64, 128) for bn in (64, 128) for bk in (64, 128, 256) for w in (4,) for st in (3, 4)
             if bm * bk <= 16384 and bn * bk <= 32768]
    rows = []
    for name, (N, K) in SHAPES.items():
        wt = B.Weight(N, K)
        for M in (32, 64, 128, 256):
            x = torch.randn(M, K, device="cuda").bfloat16()
            ref = x.float() @ Q.dequantize_int8(wt.q, wt.s).T
            lib = wt.int8_us(x); bf = wt.bf16_us(x)
            res = {}
            for t in TILES:
                try:
                    err = ((swap_linear(x, wt.q, wt.s, t).float() - ref).abs().max() / ref.abs().max()).item()
                    if err > 1e-2: continue
                    res[t] = B.per_call_us([lambda q=q, s=s: swap_linear(x, q, s, t) for q, s in wt.q8s])
                except Exception as e: pass
            best = min(res, key=res.get)
            rows.append({"weight": name, "M": M, "bf16_us": bf, "library_us": lib, "swap_best": list(best), "swap_us": res[best],
                         "swap_all": {str(k): v for k, v in res.items()}})
            print(f"{name:8} M={M:4} bf16 {bf:6.1f} library {lib:6.1f} swap {res[best]:6.1f} {best}", file=sys.stderr, flush=True)
        del wt; torch.cuda.empty_cache()
    print(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
