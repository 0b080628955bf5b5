"""Chapter 9c's int8 weight-only matmul against the bf16 one, on the Llama-3.2-1B matmul shapes; prints JSON.

For each weight (q/k/v stacked, o, gate/up stacked, down, the LM head) and each number of rows M (the sequences of a
decode step, or the tokens of a prefill): nanoserve.quantization.int8_linear as the engine calls it (the GEMV for one
row, the tiled kernel below INT8_DEQUANT_ROWS rows, a dequantized F.linear from there), against the bf16 weight through
chapter 9b's `linear` as the engine calls it (its GEMV for one row, cuBLAS for more), and the dequantization alone.
Bandwidth fractions are the bytes a matmul must move (weight, input, output) over its time, against a device-to-device
copy measured in the same run.

Times are per call inside a CUDA graph of back-to-back calls, each on its own copy of the weight (at least 1 GiB of
copies, so no call finds its weight in L2), as a decode step's graph runs them: the median of triton.testing.do_bench
over replays of that graph, divided by the calls in it.

    python benchmarks/int8_linear.py --out benchmarks/results/int8_linear_h100.json     # ~2 min on an H100
    python benchmarks/int8_linear.py --sweep > sweep.json    # time INT8_GEMV and INT8_TILES candidates instead
    python benchmarks/int8_linear.py --sweep-splits > splits.json    # time INT8_SPLIT_PROGRAMS candidates instead

Progress goes to stderr; stdout gets only the JSON.
"""
import argparse, datetime, json, sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
try:
    import nanoserve  # noqa: F401
except ImportError:  # not installed: run from the checkout
    sys.path.insert(0, str(ROOT))
import nanoserve.quantization as quantization
import paged_attention as pa  # noqa: E402  (its CUDA-graph capture and commit helper)
from nanoserve.benchmark import copy_bandwidth
from nanoserve.fused_ops import linear
from nanoserve.quantization import (INT8_DEQUANT_ROWS, INT8_TILES, INT8_WIDE, dequantize_int8, int8_linear, int8_splits, int8_tile,
                                    quantize_int8)

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192), "lm_head": (128256, 2048)}
LAYER = ("qkv", "o", "gate_up", "down")  # the matmuls of one decoder layer
ROWS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
LM_HEAD_ROWS = 256  # the LM head multiplies one row per sequence, never a prompt's
COPY_BYTES, MAX_COPIES = 2**30, 256  # weight bytes per timed graph, and its most calls
SWEEP_GEMV = [(bn, bk, w, st) for bn in (1, 2, 4, 8) for bk in (512, 1024, 2048, 4096) for w in (4,) for st in (1, 2, 3)
              if bn * bk <= 16384]
SWEEP_ROWS = (8, 32, 64, 128, 256)
SWEEP_SPLIT_PROGRAMS = (0, 1, 2, 4, 8)  # candidates for INT8_SPLIT_PROGRAMS (0: never split)
SWEEP_TILES = [(16, 32, 256, 4, 4), (16, 64, 256, 4, 4), (16, 32, 512, 4, 3), (16, 16, 256, 4, 4), (32, 32, 256, 4, 4),
               (32, 64, 128, 4, 4), (64, 32, 128, 4, 4), (64, 64, 128, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4),
               (128, 64, 64, 4, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 3), (16, 32, 256, 4, 6), (16, 64, 128, 4, 5)]


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def us(fn) -> float:
    return 1e3 * triton.testing.do_bench(pa.graphed(fn), warmup=10, rep=50, return_mode="median")


def per_call_us(calls) -> float:
    "Microseconds per call of `calls` (functions) run back to back in one CUDA graph."
    def run():
        for call in calls: call()
    return us(run) / len(calls)


class Weight:
    "Copies of one random (N, K) weight, as bf16 and as int8 with scales, enough that the calls of a graph miss L2."
    def __init__(self, N, K):
        w = torch.randn(N, K, device="cuda") * 0.02
        self.N, self.K, self.bf16 = N, K, w.bfloat16()
        self.q, self.s = quantize_int8(w)
        del w
        n = max(2, min(MAX_COPIES, COPY_BYTES // (N * K)))
        self.bf16s = [self.bf16] + [self.bf16.clone() for _ in range(n - 1)]
        self.q8s = [(self.q, self.s)] + [(self.q.clone(), self.s.clone()) for _ in range(n - 1)]

    def bf16_us(self, x): return per_call_us([lambda w=w: linear(x, w) for w in self.bf16s])
    def int8_us(self, x, tile=None): return per_call_us([lambda q=q, s=s: int8_linear(x, q, s, tile=tile) for q, s in self.q8s])
    def dequantize_us(self): return per_call_us([lambda q=q, s=s: dequantize_int8(q, s, torch.bfloat16) for q, s in self.q8s])

    def error(self, x, tile=None) -> float:
        ref = x.float() @ dequantize_int8(self.q, self.s).T
        return ((int8_linear(x, self.q, self.s, tile=tile).float() - ref).abs().max() / ref.abs().max()).item()


def row(name, weight: Weight, M, copy_gbs) -> dict:
    N, K = weight.N, weight.K
    x = torch.randn(M, K, device="cuda").bfloat16()
    out = {"weight": name, "N": N, "K": K, "M": M, "copies": len(weight.q8s)}
    out["bf16_us"], out["int8_us"], out["dequantize_us"] = weight.bf16_us(x), weight.int8_us(x), weight.dequantize_us()
    out["path"] = "GEMV" if M == 1 else "tiled kernel" if M < INT8_DEQUANT_ROWS else "dequantize + cuBLAS"
    out["tile"] = list(quantization.INT8_GEMV if M == 1 else int8_tile(M, N))
    if 1 < M < INT8_DEQUANT_ROWS:
        grid = triton.cdiv(M, out["tile"][0]) * triton.cdiv(N, out["tile"][1])
        out["splits"] = int8_splits(grid, K, out["tile"][2], torch.cuda.get_device_properties(0).multi_processor_count)
    io = 2 * M * (K + N)
    out["bf16_frac_copy"] = (2 * N * K + io) / out["bf16_us"] / 1e3 / copy_gbs
    out["int8_frac_copy"] = (N * K + 4 * N + io) / out["int8_us"] / 1e3 / copy_gbs
    out["speedup"] = out["bf16_us"] / out["int8_us"]
    out["max_rel_error"] = weight.error(x)
    return out


def sweep(weights: dict) -> list:
    "Times of every INT8_GEMV candidate (one row) and INT8_TILES candidate (SWEEP_ROWS rows) on each weight."
    found = []
    for name, weight in weights.items():
        x = torch.randn(1, weight.K, device="cuda").bfloat16()
        for config in SWEEP_GEMV:
            quantization.INT8_GEMV = config
            found.append({"weight": name, "M": 1, "gemv": list(config), "us": weight.int8_us(x), "max_rel_error": weight.error(x)})
        best = min((r for r in found if r["weight"] == name and r["M"] == 1), key=lambda r: r["us"])
        log(f"{name:8} M=1 best GEMV {best['gemv']} {best['us']:.2f} us")
        for M in SWEEP_ROWS:
            x = torch.randn(M, weight.K, device="cuda").bfloat16()
            for tile in SWEEP_TILES:
                found.append({"weight": name, "M": M, "tile": list(tile), "us": weight.int8_us(x, tile), "max_rel_error": weight.error(x, tile)})
            best = min((r for r in found if r["weight"] == name and r["M"] == M), key=lambda r: r["us"])
            log(f"{name:8} M={M} best tile {best['tile']} {best['us']:.2f} us")
    return found


def sweep_splits(weights: dict) -> list:
    "Times of the library's tiles with K split for each INT8_SPLIT_PROGRAMS candidate."
    found = []
    for name, weight in weights.items():
        for M in (8, 32, 64, 128):
            x = torch.randn(M, weight.K, device="cuda").bfloat16()
            for programs in SWEEP_SPLIT_PROGRAMS:
                quantization.INT8_SPLIT_PROGRAMS = programs
                found.append({"weight": name, "M": M, "split_programs": programs, "us": weight.int8_us(x), "max_rel_error": weight.error(x)})
            best = min((r for r in found if r["weight"] == name and r["M"] == M), key=lambda r: r["us"])
            log(f"{name:8} M={M} best INT8_SPLIT_PROGRAMS {best['split_programs']} {best['us']:.2f} us "
                f"(no split: {next(r['us'] for r in found if r['weight'] == name and r['M'] == M and r['split_programs'] == 0):.2f})")
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--sweep", action="store_true", help="time tile candidates instead of the library's choices")
    ap.add_argument("--sweep-splits", action="store_true", help="time INT8_SPLIT_PROGRAMS candidates instead")
    args = ap.parse_args()
    copy_gbs = copy_bandwidth() / 1e9  # chapter 11c's measure, as the latency and throughput records use
    log(f"copy {copy_gbs:.0f} GB/s")
    result = {"benchmark": "int8_linear" + " --sweep" * args.sweep + " --sweep-splits" * args.sweep_splits, "device": torch.cuda.get_device_name(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **pa.git_commit(),
              "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda},
              "settings": {"INT8_GEMV": list(quantization.INT8_GEMV), "INT8_WIDE": INT8_WIDE, "INT8_DEQUANT_ROWS": INT8_DEQUANT_ROWS,
                           "INT8_SPLIT_PROGRAMS": quantization.INT8_SPLIT_PROGRAMS, "INT8_MIN_SPLIT_TILES": quantization.INT8_MIN_SPLIT_TILES,
                           "INT8_TILES": [[b if b != float("inf") else "inf", *map(list, t)] for b, *t in INT8_TILES],
                           "timer": "per call in a CUDA graph of back-to-back calls on distinct weight copies (>= 1 GiB); "
                                    "triton.testing.do_bench median of its replays"},
              "copy_bandwidth_gbs": copy_gbs}
    rows = []
    for name, (N, K) in SHAPES.items():
        weight = Weight(N, K)
        if args.sweep or args.sweep_splits:
            rows += (sweep if args.sweep else sweep_splits)({name: weight})
            continue
        for M in ROWS:
            if name == "lm_head" and M > LM_HEAD_ROWS: continue
            rows.append(row(name, weight, M, copy_gbs))
            r = rows[-1]
            log(f"{name:8} M={M:5} bf16 {r['bf16_us']:7.1f} us  int8 {r['int8_us']:7.1f} us  x{r['speedup']:.2f}  "
                f"int8 {r['int8_frac_copy']:.2f} of copy  ({r['path']})")
        del weight
        torch.cuda.empty_cache()
    result["rows"] = rows
    if not (args.sweep or args.sweep_splits):
        layer = {}
        for M in ROWS:
            mine = [r for r in rows if r["M"] == M and r["weight"] in LAYER]
            layer[M] = {key: sum(r[key] for r in mine) for key in ("bf16_us", "int8_us")}
            layer[M]["speedup"] = layer[M]["bf16_us"] / layer[M]["int8_us"]
        result["layer"] = layer
    text = json.dumps(result, indent=1)
    print(text)
    if args.out: args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
