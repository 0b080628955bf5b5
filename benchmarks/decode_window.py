"""Time chapter 9's paged decode attention with a sliding window on a CUDA GPU; print JSON (--out: also write it).

A layer with a window of W positions reads only the last W of each context, however long it is. For the KV shape of
Mistral 7B v0.1 (32 query heads, 8 KV heads of 128, a window of 4096) at batch 1/8/64 and contexts of 4096 to 32 768,
this times the kernel with the window, without it on the whole context, and without it on a context of W alone (the
same bytes as the windowed call): the windowed time should follow the last, not the second. Bandwidth counts the
bytes a call must read (decode_attention_bytes of min(S, W) positions) against a device-to-device copy measured in the
same run. Times are the median of triton.testing.do_bench over CUDA-graph replays, L2 flushed before each, as in
paged_attention.py; every windowed output is compared with chapter 8b's reference on the first sequences.

    python benchmarks/decode_window.py --out benchmarks/results/decode_window_h200.json
"""
import argparse, datetime, sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import paged_attention as pa  # noqa: E402  (its timer, inputs, copy bandwidth and commit helper)
from nanoserve.kernels import choose_num_splits, decode_attention_bytes, paged_decode_attention  # noqa: E402
from nanoserve.paged_cache import paged_attention_ref  # noqa: E402

H, K, D, WINDOW = 32, 8, 128, 4096  # Mistral 7B v0.1
BATCHES, CONTEXTS = (1, 8, 64), (4096, 16384, 32768)


def timed(q, k_cache, v_cache, tables, lens, window) -> dict:
    out = torch.empty_like(q)
    call = lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, D**-0.5, out=out, window=window)
    return pa.bench_graphed(call)


def row(B: int, S: int, block_size: int, copy_gbs: float) -> dict:
    q, k_cache, v_cache, tables, lens = pa.paged_inputs(B, S, H, K, D, block_size)
    seen = min(S, WINDOW)
    res = {"batch": B, "context": S, "window": WINDOW, "positions_read": seen,
           "num_splits": choose_num_splits(B, K, seen, torch.cuda.get_device_properties(0).multi_processor_count)}
    windowed = timed(q, k_cache, v_cache, tables, lens, WINDOW)
    full = timed(q, k_cache, v_cache, tables, lens, None)
    first = slice(0, min(B, 2))
    cu = torch.arange(first.stop + 1, dtype=torch.int32, device=q.device)
    ref = paged_attention_ref(q[first], k_cache, v_cache, tables[first], lens[first], cu, D**-0.5, WINDOW)
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, D**-0.5, window=WINDOW)[first]
    res["max_abs_error"] = (got.float() - ref.float()).abs().max().item()
    del k_cache, v_cache
    torch.cuda.empty_cache()
    q, k_cache, v_cache, tables, lens = pa.paged_inputs(B, seen, H, K, D, block_size, seed=1)
    short = timed(q, k_cache, v_cache, tables, lens, None)
    nbytes = decode_attention_bytes(B, seen, H, K, D)
    res.update(us_windowed=windowed["ms"] * 1e3, us_full_context=full["ms"] * 1e3, us_window_context_only=short["ms"] * 1e3,
               frac_copy_windowed=nbytes / (windowed["ms"] * 1e-3) / 1e9 / copy_gbs)
    del k_cache, v_cache
    torch.cuda.empty_cache()
    pa.log(f"B={B} S={S}: windowed {res['us_windowed']:.1f} us, full {res['us_full_context']:.1f} us, "
           f"{seen} positions alone {res['us_window_context_only']:.1f} us")
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    props = torch.cuda.get_device_properties(0)
    copy_gbs = pa.copy_bandwidth_gbs()
    rows = [row(B, S, args.block_size, copy_gbs) for B in BATCHES for S in CONTEXTS]
    pa.emit({"benchmark": "decode_window", "device": props.name, "versions": {"torch": torch.__version__},
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **pa.git_commit(),
             "shape": {"num_heads": H, "num_kv_heads": K, "head_dim": D, "window": WINDOW, "block_size": args.block_size,
                       "dtype": "bfloat16"},
             "timer": "triton.testing.do_bench median of CUDA-graph replays, L2 flushed before each; microseconds",
             "copy_bandwidth_gbs": copy_gbs, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
