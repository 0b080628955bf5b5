"""What cuDNN's decode kernel does that chapter 9's does not: both under Nsight Compute, shape by shape.

Chapter 13 (section 11) left chapter 9's decode kernel behind SDPA's cuDNN backend at batch 8 and 64, and no design
it measured could close the gap. This script asks the profiler what the two kernels are: grid, threads, registers,
shared memory, how many programs an SM holds, the bytes they read from DRAM, how busy the SMs are, and what their
warps wait on. Each shape runs SDPA (cuDNN, on the same data laid out contiguously), chapter 9's kernel as the library
launches it, the same kernel at one split, and at cuDNN's tile and grids (CUDNN_LIKE), one call each, under `ncu`
with the L2 cache flushed before every kernel and the clocks left alone. The parent process runs ncu on itself and
writes one JSON record.

    python benchmarks/decode_profile.py --out decode_profile.json
    python benchmarks/decode_profile.py --shapes Llama-3.2-1B:64:16384     # one shape
    python benchmarks/decode_profile.py --deeper --shapes Llama-3.2-1B:8:512  # also two buffers at cuDNN's grid

Needs a CUDA GPU and `ncu` on PATH (or in $NCU). Progress goes to stderr; stdout gets only the JSON.
"""
import argparse, csv, io, itertools, json, os, shutil, subprocess, sys
from pathlib import Path

import torch

from paged_attention import (MODELS, contiguous_kv, decode_case, emit, forced_decode, log, run_header, sdpa_call,
                             sdpa_backends)
from nanoserve.kernels import paged_decode_attention

SHAPES = ["Llama-3.2-1B:8:512", "Llama-3.2-1B:8:4096", "Llama-3.2-1B:8:16384", "Llama-3.2-1B:64:4096",
          "Llama-3.2-1B:64:16384", "Llama-3.2-1B:256:4096", "Qwen3-0.6B:8:512", "Qwen3-0.6B:8:4096", "Qwen3-0.6B:64:4096",
          "Qwen3-0.6B:64:16384"]
METRICS = ["gpu__time_duration.sum", "launch__grid_size", "launch__block_size", "launch__registers_per_thread",
    "launch__occupancy_limit_registers", "dram__bytes_read.sum", "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__shared_mem_per_block_dynamic", "launch__shared_mem_per_block_static", "launch__occupancy_limit_shared_mem",
    "launch__occupancy_limit_warps", "launch__waves_per_multiprocessor", "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed", "lts__t_sector_hit_rate.pct", "sm__cycles_active.avg",
    "sm__cycles_elapsed.avg", "smsp__inst_executed.sum",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum", "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ldgsts.sum", "l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts.sum",
    "smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct", "smsp__warp_issue_stalled_barrier_per_warp_active.pct",
    "smsp__warp_issue_stalled_wait_per_warp_active.pct", "smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct",
    "smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct", "smsp__warp_issue_stalled_mio_throttle_per_warp_active.pct"]

CUDNN_LIKE = {8: (1, 4), 64: (1,), 256: (1,)}  # batch -> split counts of the library kernel at cuDNN's tile and grid
CUDNN_LIKE_TILE = (128, 4, 3)  # 128 keys, 4 warps (cuDNN's 128 threads) and one buffer
DEEPER_TILES = [(128, 4, 5)]  # --deeper: the same with two buffers (Triton gives (stages - 1) // 2, chapter 13 section 10)


def designs(model: str, B: int, S: int, deeper: bool = False) -> dict:
    """name -> a call: SDPA's cuDNN backend on contiguous K/V, the library kernel, the library kernel at one split, and
    the library kernel at CUDNN_LIKE_TILE and the split counts of CUDNN_LIKE (cuDNN's grids, as a first run found them)."""
    q, k_cache, v_cache, tables, lens, out, scale, _ = decode_case(model, B, S)
    k4, v4 = contiguous_kv(k_cache, tables, S), contiguous_kv(v_cache, tables, S)
    ours = lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, out=out)
    def forced(tile, splits):
        with forced_decode(tile): paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, splits, out)
    runs = {"sdpa_cudnn": sdpa_call(q[:, :, None], k4, v4, scale, sdpa_backends()["cudnn"]), "ours": ours,
            "ours_1split": lambda: forced(None, 1)}
    for tile, splits in itertools.product([CUDNN_LIKE_TILE, *(DEEPER_TILES if deeper else [])], CUDNN_LIKE.get(B, ())):
        runs[f"ours_{'x'.join(map(str, tile))}_{splits}split"] = lambda tile=tile, splits=splits: forced(tile, splits)
    return runs


def child(shapes: list[str], manifest: Path, deeper: bool):
    "Run every design of every shape once between markers, inside the profiled range; write what ran, in order."
    order = []
    for shape in shapes:
        model, B, S = shape.split(":")
        runs = designs(model, int(B), int(S), deeper)
        for fn in runs.values(): fn()  # compile and pick kernels outside the profiled range
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for name, fn in runs.items():
            torch.cuda._sleep(1)  # the marker: torch's spin kernel, which nothing else launches
            fn()
            order.append({"shape": shape, "design": name})
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        del runs
        torch.cuda.empty_cache()
    manifest.write_text(json.dumps(order))


def profile(shapes: list[str], metrics: list[str], workdir: Path, deeper: bool) -> tuple[list, list, dict, list]:
    """ncu over the child; returns the kernels it profiled (a dict of metrics each), the child's design order, the
    metrics' units as ncu printed them (the raw page's are base units: ns, bytes), and the metrics it left out."""
    ncu = os.environ.get("NCU") or shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    manifest = workdir / "decode_profile_order.json"
    cmd = [ncu, "--csv", "--page", "raw", "--profile-from-start", "off", "--clock-control", "none",
           "--cache-control", "all", "--metrics", ",".join(metrics), sys.executable, __file__, "--child",
           "--manifest", str(manifest), "--shapes", *shapes, *(["--deeper"] if deeper else [])]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ncu exited {done.returncode}: {done.stderr[-2000:]}")
    text = done.stdout[done.stdout.index('"ID"'):]  # the CSV starts after the child's and ncu's own lines
    rows = list(csv.DictReader(io.StringIO(text)))
    units = next((r for r in rows if not r.get("ID", "").isdigit()), {})  # the row under the header
    keep = ["Kernel Name", "Grid Size", "Block Size", *metrics]
    return ([{k: r.get(k) for k in keep if k in r} for r in rows if r.get("ID", "").isdigit()],
            json.loads(manifest.read_text()), {k: units[k] for k in metrics if units.get(k)},
            [m for m in metrics if rows and m not in rows[0]])  # ncu drops a metric it does not know, silently


def by_design(kernels: list, order: list) -> list:
    "Cut the profiled kernels at each marker and give each piece its shape and design."
    pieces, current = [], None
    for k in kernels:
        if "spin_kernel" in k["Kernel Name"]:
            current = []
            pieces.append(current)
        elif current is not None:
            current.append(k)
    if len(pieces) != len(order):
        raise RuntimeError(f"{len(pieces)} markers in the profile for {len(order)} designs")
    return [{**o, "kernels": p} for o, p in zip(order, pieces)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--shapes", nargs="+", default=SHAPES, help="model:batch:context, the model one of " + ", ".join(MODELS))
    p.add_argument("--deeper", action="store_true", help="also the cuDNN-like tile with two buffers (DEEPER_TILES)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--manifest", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.shapes, args.manifest, args.deeper)
    if not torch.cuda.is_available(): sys.exit("needs a CUDA GPU")
    res = {**run_header("decode_profile"), "timer": "Nsight Compute gpu__time_duration of one call (ns), clocks not "
           "locked, caches flushed before every kernel", "shapes": args.shapes, "deeper": args.deeper}
    workdir = (args.out.parent if args.out else Path.cwd())
    kernels, order, units, missing = profile(args.shapes, METRICS, workdir, args.deeper)
    if missing: log(f"ncu left out metrics it does not know: {missing}")
    res.update(units=units, missing_metrics=missing, designs=by_design(kernels, order))
    emit(res, args.out)


if __name__ == "__main__":
    main()
