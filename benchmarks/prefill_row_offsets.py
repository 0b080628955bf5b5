"""Chapter 9's prefill kernel with 32-bit query-row offsets (the library's choice below 2**31) against 64-bit ones
(WIDE_ROWS, which it takes only when a q or out offset passes 2**31), at paged_attention.py's prefill shapes.

Commit ad35c57 addressed every query row in 64 bits. paged_attention.py's next H200 run showed prefill for heads of 64
6-12 % slower than the run before it, with decode and SDPA unchanged. This script times both in one process, in the order
32 64 64 32, with the outputs compared bit for bit. Times are medians of triton.testing.do_bench over CUDA-graph replays,
in microseconds.

    python benchmarks/prefill_row_offsets.py --out prefill_row_offsets.json
"""
import argparse, sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
import nanoserve.kernels as kernels
import paged_attention as pa


def time_prefill(model, B, S, wide: bool) -> tuple:
    "(microseconds, output) of one call on fresh prompts, 64-bit row offsets forced on or left to the library (off)."
    H, K, D = pa.MODELS[model]
    _, k_cache, v_cache, tables, lens = pa.paged_inputs(B, S, H, K, D, 16)
    q = torch.randn(B * S, H, D, dtype=torch.bfloat16, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    cu = torch.arange(0, B * S + 1, S, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    saved = kernels.offsets_pass_int32
    if wide: kernels.offsets_pass_int32 = lambda *tensors: True
    try:
        fn = lambda: kernels.paged_prefill_attention(q, k_cache, v_cache, tables, lens, cu, D**-0.5, max_seqlen_q=S, out=out)
        fn()
        return round(pa.bench(pa.graphed(fn))["ms"] * 1e3, 1), out.clone()
    finally:
        kernels.offsets_pass_int32 = saved


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for model in pa.MODELS:
        for B, S in pa.PREFILL:
            runs = [time_prefill(model, B, S, wide) for wide in (False, True, True, False)]
            row = dict(model=model, batch=B, prompt=S, us_32_bit=[runs[0][0], runs[3][0]], us_64_bit=[runs[1][0], runs[2][0]],
                       equal_outputs=all(torch.equal(runs[0][1], r[1]) for r in runs))
            print(row, file=sys.stderr)
            rows.append(row)
    pa.emit({**pa.run_header("prefill_row_offsets"), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
