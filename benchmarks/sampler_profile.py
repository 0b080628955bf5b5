"""Where chapter 6b's sampler spends its time with top-p over Llama 3's vocabulary: the whole call and its parts, for one
row and for 256, on a GPU, with a torch.profiler table of each. Prints JSON (the tables as text).

    python benchmarks/sampler_profile.py [--out results.json]
"""
import argparse, json, statistics, sys, time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

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


def parts(B: int, device) -> dict:
    logits = torch.randn(B, VOCAB, device=device, dtype=torch.bfloat16)
    params = [SamplingParams(temperature=0.8, top_p=0.95)] * B
    t = SamplingTensors.from_params(params, VOCAB, device)
    scaled = logits.float() / t.temperature[:, None]
    row = {"batch": B,
           "sample_top_p_ms": wall_ms(lambda: sample(logits, params)),
           "sample_temperature_only_ms": wall_ms(lambda: sample(logits, [SamplingParams(temperature=0.8)] * B)),
           "sample_greedy_ms": wall_ms(lambda: sample(logits, [SamplingParams(temperature=0)] * B)),
           "sampling_tensors_ms": wall_ms(lambda: SamplingTensors.from_params(params, VOCAB, device)),
           "filter_logits_ms": wall_ms(lambda: filter_logits(scaled, t.top_k, t.top_p, t.min_p)),
           "sort_ms": wall_ms(lambda: scaled.sort(dim=-1, descending=True)),
           "race_ms": wall_ms(lambda: exponential_race(scaled.softmax(-1)))}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10): sample(logits, params)
        torch.cuda.synchronize()
    row["profile_of_10_calls"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    res = {"benchmark": "sampler_profile", "device": torch.cuda.get_device_name(device),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
           "settings": {"vocab": VOCAB, "dtype": "bfloat16", "timer": "median wall time of each call until the GPU is done"},
           "rows": [parts(B, device) for B in (1, 256)]}
    text = json.dumps(res, indent=1)
    print(text)
    if args.out: args.out.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
