"""Time chapter 9's paged decode attention on RAGGED batches, as the engine runs it; print JSON (--out: also write it).

benchmarks/paged_attention.py and decode_sweep.py time batches whose sequences all have one length. The engine's
batches are ragged: in the throughput benchmark (chapter 11c) prompts and outputs are uniform in [100, 1024], so a
decode step holds contexts from about 100 to 2048 positions, and its block tables are max_model_len / 16 = 128 blocks
wide. With one program per (KV head, sequence, split), the longest context's programs finish last and set the
kernel's time, which favours larger tiles than a uniform batch does. This script builds such batches (contexts
uniform in [100, 2048], blocks scattered at random over a pool in the engine's layout, tables 128 wide, splits
from decode_num_splits) for the KV shapes of Llama-3.2-1B and Qwen3-0.6B at batch 8 to 256, and times the kernel with DECODE_TILES ("table") and with each
tile of TILES forced for every shape; every output is compared with the table's (DECODE_TILES, or DECODE_TILES_FP8
with --kv-cache-dtype fp8, which stores the pools in 8 bits). Times are the median of
triton.testing.do_bench over CUDA-graph replays, L2 flushed before each, as in paged_attention.py. There is no SDPA
column: SDPA needs one length per batch, and padding to the longest would charge it for work the paged kernel skips.

    python benchmarks/decode_ragged.py --out benchmarks/results/decode_ragged_h100.json
"""
import argparse, datetime, itertools, random, sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import paged_attention as pa  # noqa: E402  (its timer, models and commit helper)
import nanoserve.kernels as kernels  # noqa: E402
from nanoserve.kernels import paged_decode_attention  # noqa: E402

BATCHES = (8, 32, 64, 128, 256)
CONTEXTS = (100, 2048)  # uniform, inclusive
TABLE_WIDTH = 128  # blocks: max_model_len 2048 of the throughput benchmark
TILES = [(64, 4, 2), (16, 2, 2), (16, 2, 3), (32, 4, 3), (64, 4, 3), (64, 2, 3), (128, 4, 3), (128, 4, 1)]
EXTRA_TILES = {64: [(256, 4, 3), (256, 8, 3), (64, 4, 7), (64, 4, 5)],  # heads of 64: 256 keys, as many bytes per tile as
               128: [(32, 4, 7), (32, 2, 7)]}  # 128 keys of 128; deeper pipelines: three tiles in flight with 7 stages


def ragged_batch(B, H, K, D, seed):
    "q, caches, block tables and context lengths of B sequences with contexts uniform in CONTEXTS."
    rng = random.Random(seed)
    lens = [rng.randint(*CONTEXTS) for _ in range(B)]
    nb = [triton.cdiv(S, 16) for S in lens]
    torch.manual_seed(seed)
    k_cache, v_cache = pa.random_pools(sum(nb), 16, K, D)  # laid out as the engine's cache
    perm, rows, start = torch.randperm(sum(nb)).tolist(), [], 0
    for n in nb:
        rows.append(perm[start:start + n] + [-1] * (TABLE_WIDTH - n))
        start += n
    bt = torch.tensor(rows, dtype=torch.int32, device="cuda")
    q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
    return q, k_cache, v_cache, bt, torch.tensor(lens, dtype=torch.int32, device="cuda")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--one-wave", action="store_true", help="nanoserve.kernels.DECODE_ONE_WAVE = True")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="fp8: the pools in float8_e4m3fn (chapter 9c)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available(): sys.exit("needs a CUDA GPU")
    if args.one_wave: kernels.DECODE_ONE_WAVE = True
    table_tile, num_sms = kernels.decode_tile, kernels._num_sms(torch.device("cuda"))
    rows = []
    for model, B in itertools.product(pa.MODELS, BATCHES):
        H, K, D = pa.MODELS[model]
        q, kc, vc, bt, lens = ragged_batch(B, H, K, D, seed=B)
        if args.kv_cache_dtype == "fp8": kc, vc = kc.to(kernels.FP8), vc.to(kernels.FP8)
        out, splits = torch.empty_like(q), kernels.decode_num_splits(q, kc, bt)
        fn = lambda: paged_decode_attention(q, kc, vc, bt, lens, D ** -0.5, out=out)
        row = dict(model=model, batch=B, num_splits=splits, max_context=int(lens.max()),
                   table_tile=list(table_tile(K * B * splits / num_sms, D, kc.dtype)), us={}, max_abs_diff={})
        fn(); torch.cuda.synchronize()
        ref = out.clone()
        for tile in [None] + TILES + EXTRA_TILES[D]:
            with pa.forced_decode(tile):  # None: the table's
                name = "table" if tile is None else "/".join(map(str, tile))
                fn(); torch.cuda.synchronize()
                row["max_abs_diff"][name] = (out - ref).abs().max().item()
                row["us"][name] = 1e3 * pa.bench(pa.graphed(fn))["ms"]
        best = min(row["us"], key=row["us"].get)
        row.update(best=best, table_vs_best=row["us"]["table"] / row["us"][best])
        rows.append(row)
        pa.log(f"{model:13s} B={B:3d} splits={splits}: table {row['table_tile']} {row['us']['table']:7.1f} us, "
               f"best {best} {row['us'][best]:7.1f} us, old 64/4/2 {row['us']['64/4/2']:7.1f} us")
        del q, kc, vc
    prop = torch.cuda.get_device_properties(0)
    res = {"benchmark": "decode_ragged", "device": {"name": torch.cuda.get_device_name(0), "sms": prop.multi_processor_count},
           "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda},
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **pa.git_commit(),
           "settings": {"dtype": "bfloat16", "kv_cache_dtype": args.kv_cache_dtype, "block_size": 16, "one_wave": kernels.DECODE_ONE_WAVE, "contexts": list(CONTEXTS), "table_width": TABLE_WIDTH,
                        "timer": "triton.testing.do_bench median of CUDA-graph replays, L2 flushed before each"},
           "rows": rows}
    pa.emit(res, args.out)


if __name__ == "__main__":
    main()
