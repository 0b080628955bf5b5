"""Batch-1 matrix-vector products of the Llama-3.2-1B shapes: cuBLAS (F.linear, torch.mv) against a Triton GEMV
over tile sizes. Prints JSON: microseconds and achieved bandwidth per shape and variant.

    python benchmarks/gemv_sweep.py --out gemv.json
"""
import argparse, itertools, json

import torch
import triton

from nanoserve.fused_ops import _gemv_kernel  # the engine's kernel, timed here over tile shapes


def gemv(x, w, BLOCK_N, BLOCK_K, num_warps, num_stages):
    N, K = w.shape
    out = torch.empty(N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, BLOCK_N),)](x, w, out, N, K, w.stride(0), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                            num_warps=num_warps, num_stages=num_stages, PDL=False)
    return out


def time_us(fn, iters=200):
    "Median microseconds of fn replayed in a CUDA graph of `iters` calls (no launch gaps counted... they are in a graph)."
    for _ in range(3): fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters): fn()
    ts = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); g.replay(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3 / iters)
    return sorted(ts)[2]


def main():
    p = argparse.ArgumentParser(); p.add_argument("--out"); a = p.parse_args()
    torch.manual_seed(0)
    shapes = {"qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192), "lm_head": (128256, 2048)}
    # copy bandwidth for reference
    src = torch.empty(2**28, dtype=torch.uint8, device="cuda"); dst = torch.empty_like(src)
    copy_us = time_us(lambda: dst.copy_(src), iters=20); copy_bw = 2 * src.numel() / copy_us * 1e6
    res = {"gpu": torch.cuda.get_device_name(), "copy_bytes_per_s": copy_bw, "shapes": {}}
    for name, (N, K) in shapes.items():
        copies = max(2, -(-2**30 // (N * K * 2)))  # enough distinct weights that none is in L2 when it is read again
        ws = [torch.randn(N, K, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
        it = iter(range(10**9))
        x = torch.randn(1, K, dtype=torch.bfloat16, device="cuda")
        w = ws[0]
        ref = (x.float() @ w.float().T)[0]
        nbytes = w.numel() * 2
        row = {"bytes": nbytes}
        nxt = lambda: ws[next(it) % copies]  # each call in the graph reads the next copy
        row["F.linear"] = time_us(lambda: torch.nn.functional.linear(x, nxt()))
        row["torch.mv"] = time_us(lambda: torch.mv(nxt(), x[0]))
        best = None
        for BN, BK, nw, ns in itertools.product((2, 4, 8, 16), (256, 512, 1024), (4, 8), (1, 2, 3, 4)):
            if BN * BK > 16384: continue
            try:
                out = gemv(x[0], w, BN, BK, nw, ns)
                err = (out.float() - ref).abs().max().item()
                us = time_us(lambda: gemv(x[0], nxt(), BN, BK, nw, ns))
            except Exception as e:  # out of resources
                continue
            if best is None or us < best[0]: best = (us, dict(BLOCK_N=BN, BLOCK_K=BK, num_warps=nw, num_stages=ns), err)
        row["triton_best_us"], row["triton_best_config"], row["triton_max_err"] = best
        row["cublas_err"] = (torch.nn.functional.linear(x, w)[0].float() - ref).abs().max().item()
        for k in ("F.linear", "torch.mv", "triton_best_us"): row[k + "_bw_fraction"] = nbytes / row[k] * 1e6 / copy_bw
        res["shapes"][name] = row
        print(name, json.dumps(row), flush=True)
    print(json.dumps(res, indent=1))
    if a.out: json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
