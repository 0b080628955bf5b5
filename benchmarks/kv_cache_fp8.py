"""An 8-bit KV cache (chapter 9c) on a CUDA GPU: decode attention over a float8_e4m3fn cache against the same kernel over
bfloat16, for the KV shapes of Llama-3.2-1B and Qwen3-0.6B, with the outputs' largest difference; and, with --engine, the
engine's KV blocks and output rate with each cache (random weights). Prints JSON.

    python benchmarks/kv_cache_fp8.py [--engine benchmarks/configs/Llama-3.2-1B] [--out results.json]
    python benchmarks/kv_cache_fp8.py --tiles      # the 8-bit cache's decode time with each tile of TILES
"""
import argparse, datetime, gc, platform, sys
from pathlib import Path

import torch

from engine_rates import engine_rates  # benchmarks/, this script's folder
from paged_attention import MODELS, bench_graphed, copy_bandwidth_gbs, emit, forced_decode, free_bytes, git_commit, paged_inputs
import nanoserve.kernels as kernels
from nanoserve.kernels import FP8, decode_attention_bytes, paged_decode_attention

SHAPES = [(8, 4096), (64, 4096), (256, 4096), (8, 16384), (64, 16384), (1, 16384)]  # (B, S)


def decode_pair(model: str, B: int, S: int) -> dict:
    "The decode kernel over one bfloat16 cache and over the same values in 8 bits."
    H, K, D = MODELS[model]
    row = dict(model=model, batch=B, context=S)
    if 2 * B * S * K * D * 3 + (2 << 30) > free_bytes(): return {**row, "skipped": "not enough GPU memory"}
    q, k16, v16, bt, lens = paged_inputs(B, S, H, K, D, 16)
    scale, out16, out8 = D**-0.5, torch.empty_like(q), torch.empty_like(q)
    k8, v8 = k16.to(FP8), v16.to(FP8)  # the same strides: the engine's head-major blocks
    t16 = bench_graphed(lambda: paged_decode_attention(q, k16, v16, bt, lens, scale, out=out16))
    t8 = bench_graphed(lambda: paged_decode_attention(q, k8, v8, bt, lens, scale, out=out8))
    bytes16, bytes8 = decode_attention_bytes(B, S, H, K, D), decode_attention_bytes(B, S, H, K, D, FP8) + 2 * B * H * D  # q, out: bf16
    splits = kernels.decode_num_splits(q, k16, bt)
    tiles = {name: kernels.decode_tile(K * B * splits / kernels._num_sms(q.device), D, dtype) for name, dtype in (("bf16", k16.dtype), ("fp8", FP8))}
    return {**row, "splits": splits, "tiles": tiles, "bf16_ms": t16["ms"], "fp8_ms": t8["ms"],
            "speedup": t16["ms"] / t8["ms"], "bf16_gbs": bytes16 / t16["ms"] / 1e6, "fp8_gbs": bytes8 / t8["ms"] / 1e6,
            "max_abs_diff": (out8.float() - out16.float()).abs().max().item(), "max_abs_out": out16.float().abs().max().item()}


TILES = [(128, 4, 3), (64, 2, 3), (128, 8, 3), (256, 4, 3), (256, 8, 3), (128, 4, 5), (256, 8, 1)]  # (BLOCK_N, warps, stages)


def fp8_tiles(model: str, B: int, S: int) -> dict:
    "The decode kernel over an 8-bit cache with each tile of TILES forced (the library's splits), and over bfloat16 as chosen."
    H, K, D = MODELS[model]
    q, k16, v16, bt, lens = paged_inputs(B, S, H, K, D, 16)
    k8, v8, out, scale = k16.to(FP8), v16.to(FP8), torch.empty_like(q), D**-0.5
    row = dict(model=model, batch=B, context=S, splits=kernels.decode_num_splits(q, k16, bt), fp8_us={}, failed={})
    row["bf16_us"] = 1e3 * bench_graphed(lambda: paged_decode_attention(q, k16, v16, bt, lens, scale, out=out))["ms"]
    ref = paged_decode_attention(q, k8, v8, bt, lens, scale).float()
    for tile in [None] + TILES:
        name = "table" if tile is None else "/".join(map(str, tile))
        try:
            with forced_decode(tile):
                fn = lambda: paged_decode_attention(q, k8, v8, bt, lens, scale, out=out)
                fn()
                assert (out.float() - ref).abs().max().item() < 0.02, "output differs from the table tile's"
                row["fp8_us"][name] = 1e3 * bench_graphed(fn)["ms"]
        except Exception as e:  # a tile that does not fit is reported, not fatal
            row["failed"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return row


def engine(model: str) -> dict:
    """The engine on `model` with each cache: its KV blocks and its output rate on requests of 2048 + 256 tokens; the
    8-bit cache also with the 16-bit cache's decode tiles (DECODE_TILES_FP8 = DECODE_TILES), the runs alternated."""
    runs, own = {}, kernels.DECODE_TILES_FP8
    for name in ("auto", "fp8", "fp8, 16-bit tiles", "auto_again", "fp8_again", "fp8, 16-bit tiles_again"):
        kernels.DECODE_TILES_FP8 = kernels.DECODE_TILES if "16-bit tiles" in name else own
        try:
            runs[name] = engine_rates(model, {"greedy": dict(temperature=0)}, num_requests=256, prompt_len=2048, output_len=256,
                                      kv_cache_dtype="fp8" if name.startswith("fp8") else "auto")
        finally: kernels.DECODE_TILES_FP8 = own
        gc.collect(); torch.cuda.empty_cache()
    return runs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--engine", help="also run the engine on this model config (random weights) with each cache")
    p.add_argument("--tiles", action="store_true", help="only time the 8-bit cache with each decode tile of TILES")
    args = p.parse_args(argv)
    if args.tiles:
        res = {"benchmark": "kv_cache_fp8 --tiles", "device": torch.cuda.get_device_name(), **git_commit(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "timer": "triton.testing.do_bench median of CUDA-graph replays, L2 flushed before each; microseconds",
               "rows": [fp8_tiles(m, B, S) for m in MODELS for B, S in SHAPES + [(64, 512), (256, 512)]]}
        return emit(res, args.out)
    device = torch.device("cuda")
    res = {"benchmark": "kv_cache_fp8", "device": torch.cuda.get_device_name(device),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **git_commit(),
           "versions": {"torch": torch.__version__, "python": platform.python_version()},
           "timer": "triton.testing.do_bench median of CUDA-graph replays, L2 flushed before each", "block_size": 16,
           "copy_bandwidth_gbs": copy_bandwidth_gbs(),
           "decode": [decode_pair(m, B, S) for m in MODELS for B, S in SHAPES]}
    if args.engine: res["engine"] = engine(args.engine)
    emit(res, args.out)


if __name__ == "__main__":
    sys.exit(main())
