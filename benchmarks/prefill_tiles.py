"""Time chapter 9's paged PREFILL attention with each of a few tiles (PREFILL_BLOCK_M/N, warps, stages) on a CUDA GPU,
against SDPA's causal attention on the same data laid out contiguously; print JSON (--out: also write it).

The shapes are benchmarks/paged_attention.py's fresh prompts (PREFILL), for the KV shapes of Llama-3.2-1B and
Qwen3-0.6B, and chunks as chunked prefill runs them: CHUNKS new tokens after a cached context. Some tiles are also
timed with PREFILL_LONGEST_FIRST (each prompt's last query tiles, which see the most keys, launched first). Every output is
compared with the library tile's (PREFILL_* as committed, checked against the reference by tests/test_kernels.py on
the GPU) on the same inputs, so a tile that computes something else is reported, not timed. Times are the median of
triton.testing.do_bench over CUDA-graph replays, L2 flushed before each, as in paged_attention.py.

    python benchmarks/prefill_tiles.py --out prefill_tiles.json
    python benchmarks/prefill_tiles.py --engine configs/Qwen3-0.6B --tile 128 128 8 3   # the engine, library tile vs this one

With --engine, the engine (random weights) runs ENGINE_WORKLOADS with the library's tile and with --tile, alternated
ROUNDS times, each run on a new LLM so that its CUDA graphs hold the tile of their run.
"""
import argparse, datetime, gc, itertools, sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import paged_attention as pa  # noqa: E402  (its timer, models, inputs and commit helper)
import nanoserve.kernels as kernels  # noqa: E402
from nanoserve.kernels import paged_prefill_attention  # noqa: E402

CONSTANTS = ("PREFILL_BLOCK_M", "PREFILL_BLOCK_N", "PREFILL_NUM_WARPS", "PREFILL_NUM_STAGES", "PREFILL_LONGEST_FIRST")
TILES = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 2),
         (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 4, 3)]  # (BLOCK_M, BLOCK_N, warps, stages)
LONGEST_FIRST = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)]  # also timed with that launch order
VARIANTS = [t + (False,) for t in TILES] + [t + (True,) for t in LONGEST_FIRST]
CHUNKS = ((8, 512, 2048), (4, 2048, 8192))  # (B, new tokens, context including them)
ENGINE_WORKLOADS = {"long-prompts": dict(num_requests=256, prompt_len=2048, output_len=32),  # mostly prefill
                    "mixed": dict(num_requests=256, prompt_len=512, output_len=256)}
ROUNDS = 2


def with_tile(tile, fn):
    "Run fn with the PREFILL_* constants set to `tile`, then put them back."
    saved = [getattr(kernels, c) for c in CONSTANTS]
    try:
        for c, v in zip(CONSTANTS, tile): setattr(kernels, c, v)
        return fn()
    finally:
        for c, v in zip(CONSTANTS, saved): setattr(kernels, c, v)


def row(model: str, B: int, T: int, S: int) -> dict:
    "B sequences of S positions whose last T are new: each tile's time, its largest difference from the library's, SDPA."
    H, K, D = pa.MODELS[model]
    _, k_cache, v_cache, bt, lens = pa.paged_inputs(B, S, H, K, D, 16)
    q = torch.randn(B * T, H, D, dtype=torch.bfloat16, device="cuda")
    cu = torch.arange(0, B * T + 1, T, dtype=torch.int32, device="cuda")
    scale, out = D**-0.5, torch.empty_like(q)
    run = lambda: paged_prefill_attention(q, k_cache, v_cache, bt, lens, cu, scale, max_seqlen_q=T, out=out)
    run()
    ref = out.float().clone()
    flops = 4 * B * H * D * T * (2 * S - T + 1) / 2  # causal: query i sees S - T + i + 1 keys
    res = dict(model=model, batch=B, new_tokens=T, context=S, us={}, tflops={}, max_abs_diff={}, failed={})
    for tile in VARIANTS:
        name = "/".join(map(str, tile[:4])) + " longest first" * tile[4]
        try:
            with_tile(tile, run)
            res["max_abs_diff"][name] = (out.float() - ref).abs().max().item()
            if res["max_abs_diff"][name] > 0.02: raise AssertionError(f"differs from the library tile's by {res['max_abs_diff'][name]}")
            ms = with_tile(tile, lambda: pa.bench(pa.graphed(run))["ms"])
            res["us"][name], res["tflops"][name] = 1e3 * ms, flops / (ms * 1e-3) / 1e12
        except Exception as e:  # a tile that does not fit (shared memory) or computes something else: reported, not fatal
            res["failed"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    k4, v4 = pa.contiguous_kv(k_cache, bt, S), pa.contiguous_kv(v_cache, bt, S)
    q4 = q.view(B, T, H, D).transpose(1, 2)
    if T == S:  # SDPA's causal mask is top-left aligned: only fresh prompts compare
        ok = {n: ms for n, ms in pa.time_sdpa(q4, k4, v4, scale, causal=True).items() if ms}
        if ok: res["sdpa_us"] = 1e3 * min(ok.values())
    best = min(res["us"], key=res["us"].get)
    pa.log(f"{model:13s} B={B} T={T} S={S}: library {res['us'].get('64/64/4/2', float('nan')):8.1f} us, best {best} "
           f"{res['us'][best]:8.1f} us, SDPA {res.get('sdpa_us', float('nan')):8.1f} us")
    return res


def engine(model: str, tile: tuple, workloads: list) -> tuple:
    """Output tokens/s of LLM.generate (greedy) per workload, with the library's prefill tile and with `tile`, alternated
    in the order A B B A ..., and each run's KV blocks (equal, if every engine got the same cache)."""
    from engine_rates import engine_rates
    runs, blocks, pair = {}, {}, (("library", None), ("tile", tile))
    order = [p for r in range(ROUNDS) for p in (pair if r % 2 == 0 else pair[::-1])]
    for workload, (name, t) in itertools.product(workloads, order):
        go = lambda: engine_rates(model, {"greedy": dict(temperature=0)}, **ENGINE_WORKLOADS[workload])
        res = go() if t is None else with_tile(tuple(t) + (kernels.PREFILL_LONGEST_FIRST,), go)
        rate = res["output_tokens_per_s"]["greedy"]
        runs.setdefault(workload, {}).setdefault(name, []).append(round(rate, 1))
        blocks.setdefault(workload, {}).setdefault(name, []).append(res["num_kv_blocks"])
        pa.log(f"{model} {workload} {name}: {rate:,.0f} output tokens/s")
        gc.collect(); torch.cuda.empty_cache()
    return runs, blocks


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--engine", help="run the engine on this model config instead (random weights), library tile vs --tile")
    p.add_argument("--tile", type=int, nargs=4, default=[128, 128, 8, 3], metavar=("BLOCK_M", "BLOCK_N", "WARPS", "STAGES"))
    p.add_argument("--workloads", nargs="+", default=list(ENGINE_WORKLOADS), choices=list(ENGINE_WORKLOADS))
    args = p.parse_args(argv)
    if not torch.cuda.is_available(): sys.exit("needs a CUDA GPU")
    if args.engine:
        rates, blocks = engine(args.engine, args.tile, args.workloads)
        res = {"benchmark": "prefill_tiles --engine", "model": args.engine, "device": torch.cuda.get_device_name(),
               "versions": {"torch": torch.__version__, "triton": triton.__version__},
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **pa.git_commit(),
               "library_tile": [getattr(kernels, c) for c in CONSTANTS[:4]], "tile": args.tile,
               "workloads": {w: ENGINE_WORKLOADS[w] for w in args.workloads}, "rounds": ROUNDS,
               "output_tokens_per_s": rates, "num_kv_blocks": blocks}
        return pa.emit(res, args.out)
    shapes = [(B, S, S) for B, S in pa.PREFILL] + list(CHUNKS)
    res = {"benchmark": "prefill_tiles", "device": torch.cuda.get_device_name(),
           "versions": {"torch": torch.__version__, "triton": triton.__version__},
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **pa.git_commit(),
           "library_tile": [getattr(kernels, c) for c in CONSTANTS[:4]], "library_longest_first": kernels.PREFILL_LONGEST_FIRST,
           "timer": "triton.testing.do_bench median of CUDA-graph replays, L2 flushed before each; microseconds",
           "rows": [row(m, B, T, S) for m, (B, T, S) in itertools.product(pa.MODELS, shapes)]}
    pa.emit(res, args.out)


if __name__ == "__main__":
    main()
