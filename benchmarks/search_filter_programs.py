"""Chapter 9b's search_filter with each row shared out among programs (as the engine runs it) against one program per
row: the filter alone over Llama 3's vocabulary for 1 to 256 rows, bfloat16 and float32 logits, top-p alone and with
top-k 50; then the engine's time per decode step at batch 1 and 8 (Llama-3.2-1B shape, random weights), greedy and
sampled, the two ways alternated three times, with the engine's host phases per step. Prints JSON.

    python benchmarks/search_filter_programs.py [--out results.json]
"""
import argparse, json, platform, sys, time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch

import nanoserve.fused_ops as fused
from paged_attention import git_commit  # benchmarks/, this script's folder
from sampler_profile import SETTINGS, wall_ms
from nanoserve.sampling import SamplingParams

VOCAB = 128256
MODEL = Path(__file__).parent / "configs" / "Llama-3.2-1B"


@contextmanager
def one_program_per_row(on: bool = True):
    "search_filter as before rows were shared out: no batch leaves enough SMs per program."
    saved = fused.SEARCH_SMS_PER_PROGRAM
    if on: fused.SEARCH_SMS_PER_PROGRAM = 10**9
    try: yield
    finally: fused.SEARCH_SMS_PER_PROGRAM = saved


def filter_row(B: int, dtype: torch.dtype, device) -> dict:
    g = torch.Generator(device=device).manual_seed(B)
    logits = (torch.randn(B, VOCAB, device=device, generator=g) * 3).to(dtype)
    row = {"dtype": str(dtype).removeprefix("torch."), "batch": B, "programs_per_row": fused.search_programs(B, VOCAB, device)}
    for name, kwargs in SETTINGS.items():
        rows = [torch.full((B,), v, device=device) for v in (kwargs["temperature"], kwargs.get("top_k", VOCAB), kwargs["top_p"], 0.0)]
        call = lambda: fused.search_filter(logits, *rows)
        row[f"{name}_shared_ms"] = wall_ms(call)
        with one_program_per_row(): row[f"{name}_one_program_ms"] = wall_ms(call)
    return row


def decode_steps(output_len: int = 512) -> dict:
    "Milliseconds per step of LLM.generate at batch 1 and 8, prompts of 128 tokens, each setting both ways, twice."
    from nanoserve import LLM
    llm = LLM(str(MODEL), load_format="dummy", gpu_memory_utilization=0.5, enable_chunked_prefill=False)  # as its records
    settings = {"greedy": dict(temperature=0), **SETTINGS}
    steps, phases = {}, {}
    for run in [f"{way}_{i}" for i in range(1, 4) for way in ("one_program", "shared")]:
        with one_program_per_row(run.startswith("one_program")):
            for B in (1, 8):
                prompts = [[1000 + 7 * i + j for j in range(128)] for i in range(B)]
                for name, fields in settings.items():
                    llm.generate(prompts, SamplingParams(**fields, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm
                    before, start = dict(llm.llm_engine.step_seconds), time.perf_counter()
                    llm.generate(prompts, SamplingParams(**fields, max_tokens=output_len, ignore_eos=True), use_tqdm=False)
                    steps[f"{run}_batch{B}_{name}"] = (time.perf_counter() - start) / output_len * 1e3
                    phases[f"{run}_batch{B}_{name}"] = {k: (v - before[k]) / output_len * 1e3 for k, v in llm.llm_engine.step_seconds.items()}
    return {"model": MODEL.name, "prompt_len": 128, "output_len": output_len, "ms_per_step": steps,
            "host_phases_ms_per_step": phases}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    res = {"benchmark": "search_filter_programs", "device": torch.cuda.get_device_name(device),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **git_commit(),
           "versions": {"torch": torch.__version__, "python": platform.python_version()},
           "settings": {"vocab": VOCAB, "sms_per_program": fused.SEARCH_SMS_PER_PROGRAM, "sm_count": torch.cuda.get_device_properties(device).multi_processor_count,
                        "timer": "median wall time of each filter call until the GPU is done; perf_counter around LLM.generate"},
           "filter": [filter_row(B, dtype, device) for dtype in (torch.bfloat16, torch.float32) for B in (1, 2, 4, 8, 16, 32, 64, 256)],
           "engine": decode_steps()}
    text = json.dumps(res, indent=1)
    print(text)
    if args.out: args.out.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
