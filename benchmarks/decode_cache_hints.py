"""Two last checks on the gap between chapter 9's decode kernel and SDPA (chapter 13, section 10); print JSON.

1. **An L2 hint.** The same kernel with `eviction_policy="evict_first"` on its key and value loads (compiled for
   sm_90 that is `cp.async.cg ... L2::cache_hint` with an `L2::evict_first` policy): the cache streams through
   L2 without pushing out what is reused. The variant is the library's own source with that one change, written
   to a temporary module, so nothing else differs.
2. **The flush.** triton.testing.do_bench zeroes 256 MB before every call, which leaves L2 full of dirty lines;
   the timed kernel then pays for writing them back as it reads. `clean` reads 96 MB after the zeroing, so the
   kernel starts on clean lines. If one kernel gained from the other's write-backs, the ratio would move.

Also the split count of DECODE_PROGRAMS_PER_SM = 3 where it differs from the library's (batch 8 and 64). Every
variant is replayed from a CUDA graph and compared with the library kernel's output; SDPA is the faster of torch's
default and cuDNN backends on the same data laid out contiguously, timed in the same way. Each time is the median
of `reps` calls, twice, the second round in reverse order; ratios take the better round.

    python benchmarks/decode_cache_hints.py --out benchmarks/results/performance/decode_cache_hints_h100.json
"""
import argparse, datetime, importlib.util, json, statistics, sys, tempfile
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import paged_attention as pa  # noqa: E402  (its inputs, graphs, SDPA calls and commit helper)
import nanoserve.kernels as kernels  # noqa: E402

KV_LOAD = "mask=mask, other=0.0)"  # the end of _load_kv_tile's two cache loads
CELLS = [(b, s) for b in (8, 64, 256) for s in (512, 4096, 16384)]


def evict_first_kernels():
    "nanoserve.kernels with evict_first on the key and value loads, imported from a temporary file."
    src = Path(kernels.__file__).read_text()
    if src.count(KV_LOAD) != 2: sys.exit(f"expected two loads ending {KV_LOAD!r} in {kernels.__file__}")
    src = src.replace(KV_LOAD, 'mask=mask, other=0.0, eviction_policy="evict_first")')
    path = Path(tempfile.mkdtemp()) / "kernels_evict_first.py"  # Triton reads a kernel's source from its file
    path.write_text(src.replace("from .", "from nanoserve."))  # the package's relative imports, absolute
    spec = importlib.util.spec_from_file_location("kernels_evict_first", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Timer:
    "Median microseconds of a graph replay, after a flush that leaves L2 dirty (as do_bench) or clean."
    def __init__(self):
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
        self.read = torch.ones(96 * 2**20 // 8, dtype=torch.int64, device="cuda")
        self.sink = torch.empty(1, dtype=torch.int64, device="cuda")

    def __call__(self, replay, mode: str, reps: int) -> float:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for _ in range(3): replay()
        for start, end in events:
            self.flush.zero_()
            if mode == "clean": torch.sum(self.read, 0, out=self.sink[0])
            start.record(); replay(); end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3


def variants(evict, q, kc, vc, bt, lens, scale) -> dict:
    "name -> call: the library kernel, evict_first, and both with 3 programs per SM where that changes the splits."
    B, K, S = len(q), kc.shape[2], bt.shape[1] * kc.shape[1]
    calls = {"library": lambda: kernels.paged_decode_attention(q, kc, vc, bt, lens, scale),
             "evict_first": lambda: evict.paged_decode_attention(q, kc, vc, bt, lens, scale)}
    saved, kernels.DECODE_PROGRAMS_PER_SM = kernels.DECODE_PROGRAMS_PER_SM, 3
    n3 = kernels.choose_num_splits(B, K, S, kernels._num_sms(q.device))
    kernels.DECODE_PROGRAMS_PER_SM = saved
    if n3 != kernels.choose_num_splits(B, K, S, kernels._num_sms(q.device)):
        calls["3_per_sm"] = lambda: kernels.paged_decode_attention(q, kc, vc, bt, lens, scale, num_splits=n3)
        calls["3_per_sm+evict_first"] = lambda: evict.paged_decode_attention(q, kc, vc, bt, lens, scale, num_splits=n3)
    return calls


def row(model, B, S, evict, timer) -> dict:
    H, K, D = pa.MODELS[model]
    q, kc, vc, bt, lens = pa.paged_inputs(B, S, H, K, D, 16)
    scale = D**-0.5
    calls = variants(evict, q, kc, vc, bt, lens, scale)
    ref = calls["library"]()
    errors = {n: (f().float() - ref.float()).abs().max().item() for n, f in calls.items()}
    replays = {n: pa.graphed(f) for n, f in calls.items()}
    k4, v4 = pa.contiguous_kv(kc, bt, S), pa.contiguous_kv(vc, bt, S)
    for n in ("default", "cudnn"):
        replays[f"sdpa_{n}"] = pa.graphed(pa.sdpa_call(q[:, :, None], k4, v4, scale, pa.sdpa_backends()[n]))
    reps = max(20, min(200, int(2e5 / (B * S))))
    us = {}
    for order in (list(replays), list(replays)[::-1]):
        for mode in ("dirty", "clean"):
            for n in order:
                us.setdefault(f"{mode}/{n}", []).append(round(timer(replays[n], mode, reps), 2))
    out = dict(model=model, batch=B, context=S, reps=reps, max_abs_diff_from_library=errors, us=us)
    for mode in ("dirty", "clean"):
        sdpa = min(min(us[f"{mode}/sdpa_default"]), min(us[f"{mode}/sdpa_cudnn"]))
        out[f"sdpa_time_over_ours_{mode}"] = {n: round(sdpa / min(us[f"{mode}/{n}"]), 3) for n in calls}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available(): sys.exit("needs a CUDA GPU")
    evict, timer, rows = evict_first_kernels(), Timer(), []
    for model in pa.MODELS:
        for B, S in CELLS:
            rows.append(row(model, B, S, evict, timer))
            pa.log(json.dumps({k: rows[-1][k] for k in ("model", "batch", "context", "sdpa_time_over_ours_dirty",
                                                        "sdpa_time_over_ours_clean")}))
            torch.cuda.empty_cache()
    res = {"benchmark": "decode_cache_hints", "device": torch.cuda.get_device_name(0),
           "versions": {"torch": torch.__version__, "triton": triton.__version__},
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **pa.git_commit(),
           "rows": rows}
    pa.emit(res, args.out)


if __name__ == "__main__":
    main()
