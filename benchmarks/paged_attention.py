"""Benchmark chapter 9's Triton paged attention on a CUDA GPU; print one JSON object (and write it with --out).

Decode attention in bf16 for the KV shapes of Llama-3.2-1B (32 query heads, 8 KV heads of 64) and Qwen3-0.6B
(16 query heads, 8 KV heads of 128), batch 1/8/64/256 x context 512/4096/16384, blocks of 16 scattered at random
over a pool laid out as the engine's PagedKVCache (head-major inside a block, chapter 8b). Each time is the median of triton.testing.do_bench, which zeroes a 256 MB buffer before every call,
so the L2 cache holds none of the inputs (--flush read sums it instead, so that the timed call finds no dirty lines
to write back; chapter 13, section 12). Bandwidth = decode_attention_bytes / time, compared with a large
device-to-device copy measured in the same run ((bytes read + bytes written) / time), and the time compared with
torch's scaled_dot_product_attention on the same data laid out contiguously ([B, K, S, D], enable_gqa=True;
uniform lengths, so SDPA wastes nothing on padding), best of its backends.

    python benchmarks/paged_attention.py --check --out benchmarks/results/paged_attention_h100.json
    python benchmarks/paged_attention.py --quick              # the goal configurations only
    python benchmarks/paged_attention.py --sweep --quick      # try split heuristics, print the best
    python benchmarks/paged_attention.py --decode-tile 64 4 2 --quick   # one decode tile everywhere, not DECODE_TILES
    python benchmarks/paged_attention.py --no-prefill --flush read      # empty the L2 by reading, not zeroing

The decode tile (keys per iteration, warps, pipeline stages) comes from nanoserve.kernels.DECODE_TILES by the number
of programs per SM. benchmarks/decode_ragged.py chose that table on ragged batches like the engine's;
benchmarks/decode_sweep.py searches tiles on uniform batches like these.

Progress goes to stderr; stdout gets only the JSON.
"""
import argparse, contextlib, datetime, inspect, itertools, json, math, os, statistics, subprocess, sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
try:
    import nanoserve  # noqa: F401
except ImportError:  # not installed: run from the checkout
    sys.path.insert(0, str(ROOT))
import triton

import nanoserve.kernels as kernels
from nanoserve.kernels import decode_attention_bytes, paged_decode_attention, paged_prefill_attention
from nanoserve.paged_cache import PagedKVCache, paged_attention_ref

DEVICE = "cuda"
MODELS = {"Llama-3.2-1B": (32, 8, 64), "Qwen3-0.6B": (16, 8, 128)}  # H, K, D
BATCHES, CONTEXTS = (1, 8, 64, 256), (512, 4096, 16384)
QUICK = [(8, 4096), (64, 4096), (256, 4096), (1, 16384)]  # (B, S): the goal configurations and the extremes
GOAL_B, GOAL_S, GOAL_FRAC = 64, 4096, 0.8
PREFILL = ((1, 4096), (8, 1024), (4, 8192))  # (B, S) fresh prompts
CHECK_LENS = [1, 15, 16, 17, 1000, 4096, 4097, 333, 2048, 9000]  # contexts of the --check batch
CHECK_Q_LENS = [1, 15, 16, 17, 1000, 100, 4097, 1, 2048, 500]  # and their query lengths for prefill
CHECK_UNIFORM = (8, 4096)  # (B, S) of the check against SDPA
SWEEP = ((GOAL_B, GOAL_S), (8, 4096), (8, 512), (1, 16384), (256, 4096))  # (B, S) that --sweep tunes for
TUNABLES = {  # command-line flag: the module constant it overrides
    "programs_per_sm": "DECODE_PROGRAMS_PER_SM", "min_split_tokens": "DECODE_MIN_SPLIT_TOKENS",
    "max_splits": "DECODE_MAX_SPLITS", "prefill_block_m": "PREFILL_BLOCK_M", "prefill_block_n": "PREFILL_BLOCK_N",
    "prefill_num_warps": "PREFILL_NUM_WARPS", "prefill_num_stages": "PREFILL_NUM_STAGES",
}


def log(*args):
    print(*args, file=sys.stderr, flush=True)


FLUSH = "write"  # how bench empties the L2 cache before each call: "write" (do_bench's own) or "read"


@contextlib.contextmanager
def read_flush():
    """do_bench's L2 flush made a read: its own zeroes a 256 MB buffer, which leaves the L2 full of dirty lines that
    the timed call must write back as its reads evict them (as many as the L2 holds: 50 MiB on an H100, 60 on an
    H200). Summing the buffer empties the L2 of the inputs all the same and leaves nothing to write back."""
    driver = triton.runtime.driver.active
    if "clear_cache" not in inspect.getsource(triton.testing.do_bench):
        raise RuntimeError(f"triton {triton.__version__}: do_bench does not flush through driver.clear_cache")
    own = vars(driver).get("clear_cache")  # None: the method comes from the driver's class
    driver.clear_cache = lambda cache: cache.sum()
    try:
        yield
    finally:
        if own is None: del driver.clear_cache
        else: driver.clear_cache = own


def bench(fn) -> dict:
    "Median and 20th/80th percentile milliseconds of fn over do_bench's repetitions (L2 flushed before each, see FLUSH)."
    with read_flush() if FLUSH == "read" else contextlib.nullcontext():
        times = sorted(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="all"))
    q = lambda p: times[min(len(times) - 1, int(p * len(times)))]
    return {"ms": statistics.median(times), "ms_p20": q(0.2), "ms_p80": q(0.8), "reps": len(times)}


def graphed(fn):
    "`fn` captured once in a CUDA graph; replaying it times the GPU work without Python's launch overhead."
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side): fn()  # warm up (compile, pick kernels) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph): fn()
    return graph.replay


def bench_graphed(fn) -> dict:
    "bench() of `fn` replayed from a CUDA graph (as the engine runs decode), plus the eager median for reference."
    return {**bench(graphed(fn)), "ms_eager": bench(fn)["ms"]}


@contextlib.contextmanager
def forced_decode(tile: tuple | None = None, max_splits: int | None = None):
    "nanoserve.kernels' decode tile forced to `tile` and its split cap to `max_splits` (None: the library's), then restored."
    saved = kernels.decode_tile, kernels.DECODE_MAX_SPLITS
    try:
        if tile is not None: kernels.decode_tile = lambda programs_per_sm, head_dim, cache_dtype=None: tile
        if max_splits is not None: kernels.DECODE_MAX_SPLITS = max_splits
        yield
    finally:
        kernels.decode_tile, kernels.DECODE_MAX_SPLITS = saved


def copy_bandwidth_gbs(nbytes: int = 2**30) -> float:
    "Device-to-device copy bandwidth: (bytes read + bytes written) / median time of dst.copy_(src)."
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).random_(0, 255)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))["ms"]
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


def free_bytes() -> int:
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def engine_pools(values_k: torch.Tensor, values_v: torch.Tensor) -> tuple:
    "One layer's key and value pools laid out in memory as the engine's PagedKVCache lays them out (chapter 8b), holding these values."
    pools = PagedKVCache(1, *values_k.shape, dtype=values_k.dtype, device=values_k.device)
    return pools.k[0].copy_(values_k), pools.v[0].copy_(values_v)


def random_pools(num_blocks, block_size, K, D, dtype=torch.bfloat16) -> tuple:
    "Key and value pools of random values in the engine's layout, filled in place (no second copy in memory)."
    pools = PagedKVCache(1, num_blocks, block_size, K, D, dtype=dtype, device=DEVICE)
    return pools.k[0].normal_(), pools.v[0].normal_()


def paged_inputs(B, S, H, K, D, block_size, dtype=torch.bfloat16, seed=0):
    "Uniform-length decode inputs: q (B, H, D), caches with each sequence's blocks scattered at random, tables, lens."
    torch.manual_seed(seed)
    nb = triton.cdiv(S, block_size)
    k_cache, v_cache = random_pools(B * nb, block_size, K, D, dtype)
    block_tables = torch.randperm(B * nb, device=DEVICE).view(B, nb).int()
    context_lens = torch.full((B,), S, dtype=torch.int32, device=DEVICE)
    q = torch.randn(B, H, D, dtype=dtype, device=DEVICE)
    return q, k_cache, v_cache, block_tables, context_lens


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


def sdpa_call(q4, k4, v4, scale, backend, causal=False):
    "A closure running SDPA with one backend (None: torch's own choice)."
    from torch.nn.attention import sdpa_kernel
    def run():
        if backend is None:
            return F.scaled_dot_product_attention(q4, k4, v4, scale=scale, is_causal=causal, enable_gqa=True)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q4, k4, v4, scale=scale, is_causal=causal, enable_gqa=True)
    return run


def time_sdpa(q4, k4, v4, scale, causal=False) -> dict:
    "Time every SDPA backend that accepts the inputs; the fastest is the comparison."
    results = {}
    for name, backend in sdpa_backends().items():
        fn = sdpa_call(q4, k4, v4, scale, backend, causal)
        try:
            fn()
            torch.cuda.synchronize()
            results[name] = bench(graphed(fn))["ms"]
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # backend refuses these inputs, or no memory
            results[name] = None
            log(f"    sdpa {name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            torch.cuda.empty_cache()
    return results


def decode_row(model, B, S, block_size, with_sdpa=True) -> dict:
    H, K, D = MODELS[model]
    cache_bytes = 2 * B * S * K * D * 2
    row = dict(model=model, num_heads=H, num_kv_heads=K, head_dim=D, batch=B, context=S, block_size=block_size)
    if cache_bytes + (2 << 30) > free_bytes():
        return {**row, "skipped": f"needs {cache_bytes / 2**30:.1f} GiB of KV cache"}
    q, k_cache, v_cache, bt, lens = paged_inputs(B, S, H, K, D, block_size)
    out, scale = torch.empty_like(q), D**-0.5
    num_sms, splits = kernels._num_sms(q.device), kernels.decode_num_splits(q, k_cache, bt)
    t = bench_graphed(lambda: paged_decode_attention(q, k_cache, v_cache, bt, lens, scale, out=out))
    nbytes = decode_attention_bytes(B, S, H, K, D)
    row.update(num_splits=splits, tile=list(kernels.decode_tile(K * B * splits / num_sms, D)), bytes=nbytes, **t, gbs=nbytes / (t["ms"] * 1e-3) / 1e9)
    if with_sdpa:
        if cache_bytes + (2 << 30) > free_bytes():  # the paged cache is allocated already
            row["sdpa_skipped"] = "no memory for the contiguous copy"
        else:
            k4, v4 = contiguous_kv(k_cache, bt, S), contiguous_kv(v_cache, bt, S)
            del k_cache, v_cache
            by_backend = time_sdpa(q[:, :, None], k4, v4, scale)
            ok = {n: ms for n, ms in by_backend.items() if ms is not None}
            if ok:
                best = min(ok, key=ok.get)
                row.update(sdpa_ms=ok[best], sdpa_backend=best, sdpa_ms_by_backend=by_backend,
                           speedup_vs_sdpa=ok[best] / row["ms"])
            del k4, v4
    return row


def prefill_row(model, B, S, block_size) -> dict:
    "Fresh prompts of S tokens each: our paged prefill against SDPA's causal attention on contiguous tensors."
    H, K, D = MODELS[model]
    q, k_cache, v_cache, bt, lens = paged_inputs(B, S, H, K, D, block_size)
    qf = torch.randn(B * S, H, D, dtype=torch.bfloat16, device=DEVICE)
    cu = torch.arange(0, B * S + 1, S, dtype=torch.int32, device=DEVICE)
    scale, out = D**-0.5, torch.empty_like(qf)
    t = bench_graphed(lambda: paged_prefill_attention(qf, k_cache, v_cache, bt, lens, cu, scale, max_seqlen_q=S, out=out))
    flops = 4 * B * H * D * S * (S + 1) / 2  # causal: half of S x S, two products
    row = dict(model=model, batch=B, prompt=S, block_size=block_size, **t, tflops=flops / (t["ms"] * 1e-3) / 1e12)
    k4, v4 = contiguous_kv(k_cache, bt, S), contiguous_kv(v_cache, bt, S)
    ok = {n: ms for n, ms in time_sdpa(qf.view(B, S, H, D).transpose(1, 2), k4, v4, scale, causal=True).items() if ms}
    if ok:
        best = min(ok, key=ok.get)
        row.update(sdpa_ms=ok[best], sdpa_backend=best, speedup_vs_sdpa=ok[best] / t["ms"])
    return row


def check(block_size) -> dict:
    "bf16 on the GPU against chapter 8b's reference (ragged batches) and against SDPA (a uniform batch)."
    result, worst = {}, 0.0
    for model, (H, K, D) in MODELS.items():
        g = torch.Generator().manual_seed(1)
        lens = CHECK_LENS
        nb = [triton.cdiv(S, block_size) for S in lens]
        perm = torch.randperm(sum(nb), generator=g).tolist()
        tables = [perm[sum(nb[:i]):sum(nb[:i + 1])] for i in range(len(lens))]
        width = max(nb)
        i32 = dict(dtype=torch.int32, device=DEVICE)
        bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], **i32)
        k_cache, v_cache = engine_pools(*(torch.randn(sum(nb), block_size, K, D, generator=g).bfloat16().to(DEVICE) for _ in "kv"))
        ctx = torch.tensor(lens, **i32)
        # decode
        q = torch.randn(len(lens), H, D, generator=g).bfloat16().to(DEVICE)
        ref = paged_attention_ref(q, k_cache, v_cache, bt, ctx, torch.arange(len(lens) + 1, **i32), D**-0.5)
        for n in (None, 1, 7):
            err = (paged_decode_attention(q, k_cache, v_cache, bt, ctx, D**-0.5, num_splits=n).float() - ref.float()).abs().max().item()
            result[f"{model} decode splits={n}"] = err
        # prefill: a mix of fresh prompts, continuations and a decode row
        q_lens = CHECK_Q_LENS
        cu = torch.tensor([0, *itertools.accumulate(q_lens)], **i32)
        qp = torch.randn(sum(q_lens), H, D, generator=g).bfloat16().to(DEVICE)
        ref = paged_attention_ref(qp, k_cache, v_cache, bt, ctx, cu, D**-0.5)
        err = (paged_prefill_attention(qp, k_cache, v_cache, bt, ctx, cu, D**-0.5).float() - ref.float()).abs().max().item()
        result[f"{model} prefill"] = err
        # decode against SDPA on a uniform batch
        B, S = CHECK_UNIFORM
        q, k_cache, v_cache, bt, ctx = paged_inputs(B, S, H, K, D, block_size, seed=2)
        sdpa = F.scaled_dot_product_attention(q[:, :, None], contiguous_kv(k_cache, bt, S), contiguous_kv(v_cache, bt, S),
                                              scale=D**-0.5, enable_gqa=True)[:, :, 0]
        result[f"{model} decode vs SDPA"] = (paged_decode_attention(q, k_cache, v_cache, bt, ctx, D**-0.5).float() - sdpa.float()).abs().max().item()
    worst = max(result.values())
    return {"max_abs_errors": result, "tolerance": 2e-2, "passed": worst < 2e-2}


def sweep(block_size, configs) -> dict:
    "Try split heuristics on the goal configurations; report each setting's times and the best by geometric mean."
    saved = {c: getattr(kernels, c) for c in TUNABLES.values()}
    split_rows = []
    for per_sm, min_tokens in itertools.product((1, 2, 4, 8, 16), (64, 128, 256, 512)):
        kernels.DECODE_PROGRAMS_PER_SM, kernels.DECODE_MIN_SPLIT_TOKENS = per_sm, min_tokens
        times = {f"{m} B={B} S={S}": decode_row(m, B, S, block_size, with_sdpa=False)["ms"] for m, B, S in configs}
        gm = math.exp(sum(map(math.log, times.values())) / len(times))
        split_rows.append(dict(programs_per_sm=per_sm, min_split_tokens=min_tokens, geomean_ms=gm, ms=times))
        log(f"  programs_per_sm={per_sm:2d} min_split_tokens={min_tokens:3d}: geomean {1e3 * gm:8.1f} us")
    for c, v in saved.items(): setattr(kernels, c, v)
    best = min(split_rows, key=lambda r: r["geomean_ms"])
    return {"configs": [f"{m} B={B} S={S}" for m, B, S in configs], "splits": split_rows,
            "best": dict(DECODE_PROGRAMS_PER_SM=best["programs_per_sm"], DECODE_MIN_SPLIT_TOKENS=best["min_split_tokens"])}


def constants() -> dict:
    "The launch constants in effect (DECODE_TILES with its last bound written as 'inf' for JSON)."
    return {**{c: getattr(kernels, c) for c in TUNABLES.values()}, "DECODE_ONE_WAVE": kernels.DECODE_ONE_WAVE,
            "DECODE_TILES": [[str(bound) if math.isinf(bound) else bound, {str(d): list(t) for d, t in tiles.items()}]
                             for bound, tiles in kernels.DECODE_TILES]}


def emit(res: dict, out: Path | None):
    "Print the JSON record; also write it to `out` when given."
    text = json.dumps(res, indent=1)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def git_commit() -> dict:
    if os.environ.get("GIT_COMMIT"):  # the device machine gets a copy of the tree without its history
        return {"git_commit": os.environ["GIT_COMMIT"], "git_dirty": os.environ.get("GIT_DIRTY") == "1"}
    run = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    try:
        return {"git_commit": run("rev-parse", "HEAD") or "unknown", "git_dirty": bool(run("status", "--porcelain", "--", "nanoserve"))}
    except OSError:
        return {"git_commit": "unknown", "git_dirty": None}


def run_header(benchmark: str) -> dict:
    "The fields a design script's record starts with: what ran, on which GPU and versions, when, at which commit, how timed."
    return {"benchmark": benchmark, "device": torch.cuda.get_device_name(), "sms": kernels._num_sms(torch.device(DEVICE)),
            "versions": {"torch": torch.__version__, "triton": triton.__version__},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **git_commit(),
            "timer": "triton.testing.do_bench median of CUDA-graph replays, L2 flushed; microseconds"}


def decode_case(model: str, B: int, S: int) -> tuple:
    """A design script's uniform decode case: paged_inputs at blocks of 16, an output buffer, the scale and the library
    kernel's output (float32) that every design is checked against."""
    H, K, D = MODELS[model]
    q, k_cache, v_cache, tables, lens = paged_inputs(B, S, H, K, D, 16)
    scale = D**-0.5
    return q, k_cache, v_cache, tables, lens, torch.empty_like(q), scale, \
        paged_decode_attention(q, k_cache, v_cache, tables, lens, scale).float()


def graphed_us(fn) -> float:
    "Microseconds of fn replayed from a CUDA graph (bench's median)."
    return round(bench(graphed(fn))["ms"] * 1e3, 2)


def time_designs(runs: dict, out: torch.Tensor, ref: torch.Tensor, row: dict, log):
    """Each of `runs` (name -> a call writing `out`) once for its largest error against `ref`, then timed into row["us"];
    a design that fails (a tile that does not fit) lands in row["failed"] and the others still run."""
    for name, fn in runs.items():
        try:
            out.fill_(float("nan"))  # a design that writes nothing cannot pass on the last one's output
            fn()
            row["max_abs_error"][name] = (out.float() - ref).abs().max().item()
            row["us"][name] = graphed_us(fn)
        except Exception as e:
            row["failed"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            log(f"  {name} failed: {row['failed'][name]}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--quick", action="store_true", help=f"only (B, S) in {QUICK}, no prefill")
    p.add_argument("--check", action="store_true", help="first check the kernels in bf16 against the reference; stop if they fail")
    p.add_argument("--sweep", action="store_true", help="try split heuristics on the goal configurations")
    p.add_argument("--decode-tile", nargs=3, type=int, metavar=("BLOCK_N", "WARPS", "STAGES"),
                   help="one decode tile for every shape instead of nanoserve.kernels.DECODE_TILES")
    p.add_argument("--block-size", type=int, default=16, help="cache block size (default 16)")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--flush", choices=("write", "read"), default="write", help="how the L2 cache is emptied before "
                   "each timed call: do_bench's zeroing of 256 MB (default) or a read of them, which leaves no dirty lines")
    p.add_argument("--one-wave", action="store_true", help="split no further than one wave of programs "
                   "(nanoserve.kernels.DECODE_ONE_WAVE = True)")
    for flag, const in TUNABLES.items():
        p.add_argument("--" + flag.replace("_", "-"), type=int, help=f"override nanoserve.kernels.{const}")
    args = p.parse_args(argv)
    if not torch.cuda.is_available(): sys.exit("needs a CUDA GPU")
    for flag, const in TUNABLES.items():
        if getattr(args, flag) is not None: setattr(kernels, const, getattr(args, flag))
    if args.one_wave: kernels.DECODE_ONE_WAVE = True
    global FLUSH
    FLUSH = args.flush
    if args.decode_tile:
        kernels.decode_tile = lambda programs_per_sm, head_dim, cache_dtype=None: tuple(args.decode_tile)
    prop = torch.cuda.get_device_properties(0)
    res = {
        "benchmark": "paged_attention",
        "device": {"name": torch.cuda.get_device_name(0), "sms": prop.multi_processor_count,
                   "memory_gib": round(prop.total_memory / 2**30, 1),
                   "l2_mib": round(getattr(prop, "L2_cache_size", 0) / 2**20, 1)},
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                     "python": sys.version.split()[0]},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **git_commit(),
        "settings": {"dtype": "bfloat16", "block_size": args.block_size, "quick": args.quick,
                     "timer": "triton.testing.do_bench median of CUDA-graph replays (ours and SDPA alike; 'ms_eager' is "
                              "ours launched from Python); the L2 cache is flushed before every call",
                     "flush": args.flush,
                     "constants": constants(), "decode_tile_override": args.decode_tile},
    }
    if args.check:
        log("checking the kernels in bf16 ...")
        res["check"] = check(args.block_size)
        log(json.dumps(res["check"], indent=1))
        if not res["check"]["passed"]:
            print(json.dumps(res, indent=1))
            sys.exit("check failed")
    res["copy_bandwidth_gbs"] = copy_bandwidth_gbs()
    log(f"device-to-device copy: {res['copy_bandwidth_gbs']:.0f} GB/s")
    configs = [(m, B, S) for m in MODELS for B, S in (QUICK if args.quick else itertools.product(BATCHES, CONTEXTS))]
    if args.sweep:
        goal = [(m, B, S) for m in MODELS for B, S in SWEEP]
        log("sweeping the split heuristic ...")
        res["sweep"] = sweep(args.block_size, goal)
        log(f"best: {res['sweep']['best']}")
        for const, value in res["sweep"]["best"].items(): setattr(kernels, const, value)  # measure with the best
        res["settings"]["constants"] = constants()
    res["decode"], res["skipped"] = [], []
    for model, B, S in configs:
        row = decode_row(model, B, S, args.block_size)
        if "skipped" in row:
            res["skipped"].append(row); log(f"{model} B={B} S={S}: skipped, {row['skipped']}")
            continue
        row["frac_copy"] = row["gbs"] / res["copy_bandwidth_gbs"]
        res["decode"].append(row)
        log(f"{model:13s} B={B:3d} S={S:5d} splits={row['num_splits']:2d}: {1e3 * row['ms']:8.1f} us {row['gbs']:6.0f} GB/s "
            f"({row['frac_copy']:.2f} of copy)  SDPA {1e3 * row.get('sdpa_ms', float('nan')):8.1f} us "
            f"[{row.get('sdpa_backend')}] x{row.get('speedup_vs_sdpa', float('nan')):.2f}")
    if not (args.quick or args.no_prefill):
        res["prefill"] = []
        for model, (B, S) in itertools.product(MODELS, PREFILL):
            row = prefill_row(model, B, S, args.block_size)
            res["prefill"].append(row)
            log(f"prefill {model:13s} B={B} S={S}: {1e3 * row['ms']:8.1f} us {row['tflops']:6.1f} TFLOP/s  "
                f"SDPA {1e3 * row.get('sdpa_ms', float('nan')):8.1f} us x{row.get('speedup_vs_sdpa', float('nan')):.2f}")
    goal_rows = [r for r in res["decode"] if (r["batch"], r["context"]) == (GOAL_B, GOAL_S)]
    vs_sdpa = [r["speedup_vs_sdpa"] for r in res["decode"] if r["batch"] >= 8 and "speedup_vs_sdpa" in r]
    res["goals"] = {
        f"frac_copy_at_B{GOAL_B}_S{GOAL_S}": {r["model"]: round(r["frac_copy"], 3) for r in goal_rows},
        "min_speedup_vs_sdpa_at_B>=8": min(vs_sdpa) if vs_sdpa else None,
        "met": bool(goal_rows) and all(r["frac_copy"] >= GOAL_FRAC for r in goal_rows) and bool(vs_sdpa) and min(vs_sdpa) >= 1.0,
    }
    log(f"goals: {res['goals']}")
    emit(res, args.out)


if __name__ == "__main__":
    main()
