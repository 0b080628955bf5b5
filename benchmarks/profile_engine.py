"""Where an engine step's time goes: cProfile of the host, per-phase seconds split into prefill and decode steps,
and torch.profiler's kernel table for a few decode steps. Prints JSON; used for the performance chapter.

    python benchmarks/profile_engine.py --model benchmarks/configs/Llama-3.2-1B --out profile.json
"""
import argparse, cProfile, io, json, pstats, sys, time

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.benchmark import random_requests


def timed_steps(engine):
    "Wrap engine.step to record (is_prefill, batch size, seconds) of every step."
    record, step, launch = [], engine.step, engine.runner.launch
    kind = {}
    def launch_and_note(out, *a, **k):
        kind["prefill"], kind["B"] = out.is_prefill, len(out.seqs)
        return launch(out, *a, **k)
    def timed():
        kind.clear(); t = time.perf_counter(); res = step()
        if kind: record.append((kind["prefill"], kind["B"], time.perf_counter() - t))
        return res
    engine.runner.launch, engine.step = launch_and_note, timed
    return record


def first_token(engine, prompt):
    "Milliseconds to one request's only token (max_tokens=1), step by step, best of five; torch.profiler tables of one more."
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    def once():
        engine.add_request(None, prompt, params)
        steps = []
        while engine.has_unfinished():
            t = time.perf_counter(); engine.step(); steps.append(1e3 * (time.perf_counter() - t))
        return sum(steps), steps
    best = min((once() for _ in range(5)), key=lambda r: r[0])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as tp:
        once(); torch.cuda.synchronize()
    averages = tp.key_averages()
    return {"ms": best[0], "ms_per_step": best[1], "host_ops": averages.table(sort_by="self_cpu_time_total", row_limit=25),
            "kernels": averages.table(sort_by="self_cuda_time_total", row_limit=25)}


def single_stream(llm, a, opts):
    "The kernels of one sequence's decode steps (128-token prompt), as `bench latency` runs it."
    engine = llm.llm_engine
    prompt = random_requests(1, (128, 128), (1, 1), seed=0)[0][0]
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate([prompt], [params], use_tqdm=False)  # warm-up
    prefill = first_token(engine, prompt)
    print(prefill["host_ops"], prefill["kernels"], sep="\n", file=sys.stderr)
    engine.add_request(None, prompt, params)
    for _ in range(16): engine.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as tp:
        for _ in range(20): engine.step()
        torch.cuda.synchronize()
    kernels = tp.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    engine.step_seconds = dict.fromkeys(engine.step_seconds, 0.0)
    t = time.perf_counter(); steps = 0
    while engine.has_unfinished(): engine.step(); steps += 1
    torch.cuda.synchronize()
    res = {"model": a.model, "engine_options": opts, "gpu": torch.cuda.get_device_name(), "single_stream": True,
           "ms_per_decode_step": 1e3 * (time.perf_counter() - t) / steps,
           "ms_per_step_by_phase": {k: 1e3 * v / steps for k, v in engine.step_seconds.items()},
           "first_token": {k: prefill[k] for k in ("ms", "ms_per_step")}}
    prof = cProfile.Profile()  # the host's own time per step, GPU waits included
    engine.add_request(None, prompt, params)
    for _ in range(16): engine.step()
    prof.enable()
    for _ in range(100): engine.step()
    prof.disable()
    while engine.has_unfinished(): engine.step()
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue()[:5000], file=sys.stderr)
    res["cprofile_100_steps"] = s.getvalue()
    print(kernels, file=sys.stderr)
    print(json.dumps(res, indent=1))
    if a.out: json.dump(res | {"kernels": kernels, "first_token_host_ops": prefill["host_ops"], "first_token_kernels": prefill["kernels"]},
                        open(a.out, "w"), indent=1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="benchmarks/configs/Llama-3.2-1B")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--out", default=None)
    p.add_argument("--single-stream", action="store_true", help="profile the decode steps of one 128-token request instead")
    p.add_argument("--engine-option", nargs="*", default=[], help="key=value engine options, e.g. async_scheduling=False")
    a = p.parse_args()
    opts = {k: (v == "True" if v in ("True", "False") else v) for k, v in (o.split("=") for o in a.engine_option)}
    llm = LLM(a.model, load_format="dummy", dtype="bfloat16", **{"max_model_len": 2048, **opts})  # as `bench throughput` sizes it
    if a.single_stream: return single_stream(llm, a, opts)
    reqs = random_requests(a.num_prompts, (100, 1024), (100, 1024), seed=0)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    llm.generate([ids for ids, _ in reqs[:8]], params[:8], use_tqdm=False)  # warm-up
    engine = llm.llm_engine
    record = timed_steps(engine)
    engine.step_seconds = dict.fromkeys(engine.step_seconds, 0.0)
    prof = cProfile.Profile()
    t0 = time.perf_counter(); prof.enable()
    outs = llm.generate([ids for ids, _ in reqs], params, use_tqdm=False)
    prof.disable(); seconds = time.perf_counter() - t0
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    tokens = sum(len(o.token_ids) for o in outs)
    split = {name: {"steps": sum(1 for r in record if r[0] == pre), "seconds": sum(r[2] for r in record if r[0] == pre)}
             for name, pre in (("prefill", True), ("decode", False))}
    big = [r[2] for r in record if not r[0] and r[1] >= 128]
    # a few decode steps under torch.profiler: the GPU kernels and their time
    for i in range(min(64, len(reqs))): engine.add_request(None, reqs[i][0], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    for _ in range(8): engine.step()  # prefill and warm
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as tp:
        for _ in range(10): engine.step()
    kernels = tp.key_averages().table(sort_by="cuda_time_total", row_limit=20)
    while engine.has_unfinished(): engine.step()
    res = {"model": a.model, "engine_options": opts, "gpu": torch.cuda.get_device_name(), "seconds": seconds,
           "output_tokens": tokens, "output_tokens_per_s": tokens / seconds, "step_seconds": engine.step_seconds,
           "steps": split, "decode_ms_per_step_B>=128_median": 1e3 * sorted(big)[len(big) // 2] if big else None}
    print(s.getvalue()[:6000], file=sys.stderr)
    print(kernels, file=sys.stderr)
    print(json.dumps(res, indent=1))
    if a.out:
        json.dump(res | {"cprofile": s.getvalue(), "kernels": kernels}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
