"""What one step's host-to-GPU input copy costs the host, two ways; print one JSON object (and write it with --out).

Chapter 11a sends a step's inputs (token ids, positions, slots, context lengths, block tables) to the GPU as one
array, through pinned memory. `pin_memory` is torch's copy into pinned memory, as the runner made it until
2026-11-24; `numpy_into_pinned` is `nanoserve.model_runner._to_device` now, which lets numpy fill a pinned buffer.
torch splits a copy of more than 32,768 elements over its CPU thread pool, and the pool's threads then spin,
waiting for more work, on cores that a server's HTTP process needs. Each call is followed by a pause, as a step's
other host work would follow it, and the process's CPU time over the loop (all threads, the spinning included)
is what the copy costs the machine. Sizes: a small batch, 256 sequences of 4,096 tokens (blocks of 16), and of 16,384.

    python benchmarks/pinned_copy_cost.py --out benchmarks/results/performance/pinned_copy_cost_h100.json
"""
import argparse, datetime, json, os, statistics, sys, time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    import nanoserve  # noqa: F401
except ImportError:  # not installed: run from the checkout
    sys.path.insert(0, str(ROOT))
from nanoserve.model_runner import _to_device

SIZES = {"small batch": 8_000, "256 x 4,096 tokens": 70_000, "256 x 16,384 tokens": 300_000}  # int32 elements
PAUSE_S, CALLS = 0.002, 500


def torch_pin_memory(arr: np.ndarray, device) -> torch.Tensor:
    "The runner's copy before: torch copies the array into pinned memory, then to the GPU."
    return torch.from_numpy(arr).pin_memory().to(device, non_blocking=True)


def cost(copy, arr: np.ndarray) -> dict:
    "Median wall time of one call, and the process's CPU time per call over CALLS calls each followed by a pause."
    for _ in range(20): copy(arr, "cuda")
    torch.cuda.synchronize()
    walls, cpu0 = [], time.process_time()
    for _ in range(CALLS):
        t0 = time.perf_counter()
        copy(arr, "cuda")
        walls.append(time.perf_counter() - t0)
        time.sleep(PAUSE_S)
    torch.cuda.synchronize()
    cpu = (time.process_time() - cpu0) / CALLS
    return {"wall_us": round(statistics.median(walls) * 1e6, 1), "process_cpu_ms_per_call": round(cpu * 1e3, 3)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available(): sys.exit("needs a CUDA GPU")
    rows = []
    for name, n in SIZES.items():
        arr = np.arange(n, dtype=np.int32)
        for label, copy in (("pin_memory", torch_pin_memory), ("numpy_into_pinned", _to_device)):
            assert torch.equal(copy(arr, "cuda").cpu(), torch.from_numpy(arr))
            rows.append({"size": name, "kib": n * 4 // 1024, "copy": label, **cost(copy, arr)})
            print(rows[-1], file=sys.stderr)
    result = {"benchmark": "pinned_copy_cost", "gpu": torch.cuda.get_device_name(), "cpu_count": os.cpu_count(),
              "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "pause_s": PAUSE_S, "calls": CALLS, "rows": rows}
    print(json.dumps(result, indent=1))
    if args.out: Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
