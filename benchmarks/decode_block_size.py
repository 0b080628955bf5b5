"""Does the cache's block size move decode attention? Chapter 9's decode kernel at blocks of 16, 32 and 64 tokens.

Runs benchmarks/paged_attention.py's decode_row (blocks scattered at random, CUDA-graph replays, L2 flushed) for both
KV shapes at five (batch, context) shapes, each with the library's tile and split count and, at batch 8 and context 512,
three fixed tiles with and without splits. SDPA is timed once per shape, at blocks of 16 (its data is contiguous, so
the block size does not reach it). Prints one JSON object (and writes it with --out).

    python benchmarks/decode_block_size.py --out benchmarks/results/performance/decode_block_size_h100.json
"""
import argparse, datetime, json, sys
from pathlib import Path

import torch, triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paged_attention as pa  # also puts the checkout on sys.path when nanoserve is not installed

BLOCK_SIZES = (16, 32, 64)
SHAPES = ((8, 512), (8, 4096), (64, 512), (64, 4096), (256, 512))  # (batch, context)
SHORT = (8, 512)  # where the fixed tiles are tried too
TILES = ((128, 4, 5), (128, 4, 3), (64, 2, 3))  # (keys per iteration, warps, stages)


def variants(shape):
    "(tile or None for the library's, max splits or None for the library's) to time at this shape."
    if shape != SHORT: return [(None, None)]
    return [(None, None)] + [(tile, splits) for tile in TILES for splits in (None, 1)]


def row(model, B, S, block_size, tile, max_splits, copy_gbs) -> dict:
    library = tile is None and max_splits is None
    with pa.forced_decode(tile, max_splits):
        r = pa.decode_row(model, B, S, block_size, with_sdpa=library and block_size == BLOCK_SIZES[0])
    frac_copy = r["gbs"] / copy_gbs if "gbs" in r else None
    return {**r, "tile_override": tile, "max_splits": max_splits, "frac_copy": frac_copy}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available(): sys.exit("needs a CUDA GPU")
    res = {"benchmark": "decode_block_size", "device": torch.cuda.get_device_name(0),
           "versions": {"torch": torch.__version__, "triton": triton.__version__},
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **pa.git_commit(),
           "copy_bandwidth_gbs": pa.copy_bandwidth_gbs(), "rows": []}
    for model in pa.MODELS:
        for B, S in SHAPES:
            for block_size in BLOCK_SIZES:
                for tile, max_splits in variants((B, S)):
                    r = row(model, B, S, block_size, tile, max_splits, res["copy_bandwidth_gbs"])
                    res["rows"].append(r)
                    if "skipped" in r:
                        pa.log(f"{model} B={B} S={S} block {block_size}: skipped, {r['skipped']}")
                        continue
                    pa.log(f"{model:13s} B={B:3d} S={S:5d} block {block_size:2d} tile {r['tile']} "
                           f"splits {r['num_splits']:2d}: {1e3 * r['ms']:7.2f} us ({r['frac_copy']:.3f} of copy)" +
                           (f"  SDPA {1e3 * r['sdpa_ms']:7.2f} us" if "sdpa_ms" in r else ""))
    text = json.dumps(res, indent=1)
    print(text)
    if args.out: args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
