"""Where chapter 6b's sampler spends its time over Llama 3's vocabulary: the whole call and its parts, for 1, 8, 64 and 256
rows, with top-p alone (the filter sorts) and with top-k 50 as well (it selects from SELECT_FROM_ROWS rows, else sorts), and
each with chapter 9b's search_filter instead, as the engine samples on a GPU; with torch.profiler tables of the top-p call
for 256 rows, and optionally the engine's output rate with each setting. Prints JSON (the tables as text).

    python benchmarks/sampler_profile.py [--engine benchmarks/configs/Llama-3.2-1B] [--out results.json]
    python benchmarks/sampler_profile.py --crossover
"""
import argparse, inspect, json, statistics, sys, time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engine_rates import engine_rates as shared_engine_rates  # benchmarks/, this script's folder
from nanoserve.sampling import SamplingParams, SamplingTensors, exponential_race, filter_logits, sample

VOCAB = 128256


def wall_ms(fn, reps: int = 50) -> float:
    "Median milliseconds from the call until the GPU has finished it: host and device time together."
    for _ in range(5): fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); torch.cuda.synchronize(); times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


SETTINGS = {"top_p": dict(temperature=0.8, top_p=0.95), "top_k_top_p": dict(temperature=0.8, top_k=50, top_p=0.95)}


def searching():
    "Chapter 9b's search_filter, or None in code from before it."
    try: from nanoserve.fused_ops import search_filter
    except ImportError: return None
    return search_filter


def profile_table(fn, calls: int = 10) -> str:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls): fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)


def parts(B: int, device) -> dict:
    logits = torch.randn(B, VOCAB, device=device, dtype=torch.bfloat16)
    row = {"batch": B,
           "sample_temperature_only_ms": wall_ms(lambda: sample(logits, [SamplingParams(temperature=0.8)] * B)),
           "sample_greedy_ms": wall_ms(lambda: sample(logits, [SamplingParams(temperature=0)] * B))}
    selects = "max_top_k" in inspect.signature(filter_logits).parameters  # False for the code before the filter selected
    for name, kwargs in SETTINGS.items():
        params = [SamplingParams(**kwargs)] * B
        t = SamplingTensors.from_params(params, VOCAB, device)
        scaled = logits.float() / t.temperature[:, None]
        bound = {"max_top_k": kwargs["top_k"]} if selects and "top_k" in kwargs else {}
        row[f"sample_{name}_ms"] = wall_ms(lambda: sample(logits, params))
        row[f"filter_logits_{name}_ms"] = wall_ms(lambda: filter_logits(scaled, t.top_k, t.top_p, t.min_p, **bound))
    row["sampling_tensors_ms"] = wall_ms(lambda: SamplingTensors.from_params(params, VOCAB, device))
    row["sort_ms"] = wall_ms(lambda: scaled.sort(dim=-1, descending=True))
    row["topk_50_ms"] = wall_ms(lambda: scaled.topk(50, dim=-1))
    row["race_ms"] = wall_ms(lambda: exponential_race(scaled.softmax(-1)))
    search = searching()
    for name, kwargs in SETTINGS.items():
        if not search: break
        params = [SamplingParams(**kwargs)] * B
        t = SamplingTensors.from_params(params, VOCAB, device)
        row[f"sample_{name}_searched_ms"] = wall_ms(lambda: sample(logits, params, search_filter=search))
        row[f"search_filter_{name}_ms"] = wall_ms(lambda: search(logits, t.temperature, t.top_k, t.top_p, t.min_p))
        row[f"search_filter_{name}_float32_ms"] = wall_ms(lambda: search(scaled, torch.ones_like(t.temperature), t.top_k, t.top_p, t.min_p))
    if B == 256:
        params = [SamplingParams(**SETTINGS["top_p"])] * B
        row["profile_of_10_top_p_calls"] = profile_table(lambda: sample(logits, params))
        if search: row["profile_of_10_top_p_searched_calls"] = profile_table(lambda: sample(logits, params, search_filter=search))
    return row


def select_crossover(device) -> list:
    "sample() on bfloat16 logits with top-k (50 or 1024) and top-p 0.95, selecting (topk) and sorting, for 4 to 256 rows: where SELECT_FROM_ROWS comes from."
    import triton
    from nanoserve import sampling
    rows, saved = [], (sampling.SELECT_FROM_ROWS, sampling.TOP_K_BY_SELECTION)
    for k in (50, 1024):
        for B in (4, 8, 16, 24, 32, 48, 64, 128, 256):
            logits = torch.randn(B, VOCAB, device=device, dtype=torch.bfloat16)
            params = [SamplingParams(temperature=0.8, top_k=k, top_p=0.95)] * B
            row = {"top_k": k, "B": B}
            for name, select_from, bound in (("select", 1, saved[1]), ("sort", saved[0], 0)):
                sampling.SELECT_FROM_ROWS, sampling.TOP_K_BY_SELECTION = select_from, bound
                row[f"{name}_wall_ms"] = wall_ms(lambda: sample(logits, params), reps=100)
                row[f"{name}_gpu_ms"] = triton.testing.do_bench(lambda: sample(logits, params), warmup=5, rep=100, return_mode="median")
            rows.append(row)
    sampling.SELECT_FROM_ROWS, sampling.TOP_K_BY_SELECTION = saved
    return rows


def engine_rates(model: str) -> dict:
    "Output tokens per second of LLM.generate on random-weight requests: greedy, and sampled with each of SETTINGS."
    return shared_engine_rates(model, {"greedy": dict(temperature=0.0)} | SETTINGS)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--engine", help="also time LLM.generate on this model config (random weights), greedy and with each setting")
    p.add_argument("--crossover", action="store_true", help="only time sample() selecting against sorting, for 4 to 256 rows")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    if args.crossover:
        print(json.dumps({"benchmark": "sampler_select_crossover", "device": torch.cuda.get_device_name(device),
                          "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "rows": select_crossover(device)}, indent=1))
        return
    res = {"benchmark": "sampler_profile", "device": torch.cuda.get_device_name(device),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
           "settings": {"vocab": VOCAB, "dtype": "bfloat16", "timer": "median wall time of each call until the GPU is done"},
           "rows": [parts(B, device) for B in (1, 8, 64, 256)]}
    if args.engine: res["engine"] = engine_rates(args.engine)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out: args.out.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
