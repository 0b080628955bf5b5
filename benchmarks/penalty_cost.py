"""What the penalties cost a decode step: the sampler without them, with chapter 6b's apply_penalties (dense: tables of
B x V) and with chapter 9b's apply_penalties_fused (only the tokens seen), on the device; and the host's work for the
token history: sending every token from host lists (chapter 6b's TokenHistory.from_lists) against the engine's rows kept
on the device (chapter 11a's TokenHistories), for batches of 1 to 256 rows with Llama-3's vocabulary. With --engine, the
engine's rate plainly, with the fused penalties (the engine's own) and with the dense ones, in one run. Prints JSON.

    python benchmarks/penalty_cost.py [--out results.json]
"""
import argparse, contextlib, json, os, platform, random, statistics, sys, time
from datetime import datetime, timezone
from pathlib import Path

import torch

from engine_rates import engine_rates as shared_engine_rates  # benchmarks/, this script's folder
from nanoserve.benchmark import _median_seconds
from nanoserve.fused_ops import apply_penalties_fused
from nanoserve.model_runner import ModelRunner, TokenHistories
from nanoserve.sampling import SamplingParams, TokenHistory, apply_penalties, sample
from nanoserve.scheduler import Sequence

VOCAB = 128256  # Llama 3's
PROMPT, OUTPUT = 512, 1024  # tokens each row has seen


def gpu_ms(fn) -> float:
    "Median milliseconds of fn on the GPU (chapter 11c's timer: CUDA events around each call)."
    return _median_seconds(fn, iters=50) * 1e3


def host_ms(fn, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def row(B: int, device) -> dict:
    rng = random.Random(B)
    prompts = [[rng.randrange(VOCAB) for _ in range(PROMPT)] for _ in range(B)]
    outputs = [[rng.randrange(VOCAB) for _ in range(OUTPUT)] for _ in range(B)]
    logits = torch.randn(B, VOCAB, device=device, dtype=torch.bfloat16)
    plain = [SamplingParams(temperature=0.8, top_p=0.95)] * B
    penalised = [SamplingParams(temperature=0.8, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)] * B
    history = TokenHistory.from_lists(prompts, outputs, device)
    seqs = [Sequence(i, p, penalised[0]) for i, p in enumerate(prompts)]
    for s, o in zip(seqs, outputs): s.output_token_ids = o
    rows, tokens = TokenHistories(device), torch.zeros(B, dtype=torch.long, device=device)
    def engine_step(): rows.gather(seqs); rows.append(tokens)
    engine_step()  # each sequence's row is filled once, on its first step
    return {"batch": B, "sampler_ms": gpu_ms(lambda: sample(logits, plain)),
            "sampler_with_penalties_ms": gpu_ms(lambda: sample(logits, penalised, history=history)),
            "sampler_with_fused_penalties_ms": gpu_ms(lambda: sample(logits, penalised, history=history, penalize=apply_penalties_fused)),
            "history_from_host_lists_host_ms": host_ms(lambda: TokenHistory.from_lists(prompts, outputs, device)),
            "history_rows_on_device_host_ms": host_ms(engine_step)}


@contextlib.contextmanager
def dense_penalties():
    "The engine with chapter 6b's dense apply_penalties in place of the fused kernels (the runner's `penalize` off)."
    fused = ModelRunner.penalize
    ModelRunner.penalize = property(lambda self: None)
    try: yield
    finally: ModelRunner.penalize = fused


def penalties_alone(B: int, device) -> dict:
    """apply_penalties against apply_penalties_fused alone, on float32 logits: microseconds of host time per call
    (launches queued, no wait) and of the stream's time per call (200 calls between two CUDA events)."""
    g = torch.Generator().manual_seed(B)
    logits = torch.randn(B, VOCAB, device=device)
    history = TokenHistory(torch.randint(0, VOCAB, (B, PROMPT), generator=g).to(device), torch.randint(0, VOCAB, (B, OUTPUT), generator=g).to(device))
    rows = [torch.full((B,), v, device=device) for v in (0.5, 0.5, 1.1)]
    res = {"batch": B}
    for name, fn in (("dense", apply_penalties), ("fused", apply_penalties_fused)):
        for _ in range(5): fn(logits, history, *rows)  # compiled, and the fused kernels' table allocated
        torch.cuda.synchronize(device)
        start, calls = time.perf_counter(), 200
        for _ in range(calls): fn(logits, history, *rows)
        res[f"{name}_host_us"] = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize(device)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(calls): fn(logits, history, *rows)
        end.record()
        torch.cuda.synchronize(device)
        res[f"{name}_stream_us"] = begin.elapsed_time(end) / calls * 1e3
    return res


def engine_rates(model: str) -> dict:
    """Output tokens per second of LLM.generate on random-weight requests, sampled plainly and with the three penalties,
    fused (the engine's default on a GPU) and dense, alternated."""
    base = dict(temperature=0.8, top_p=0.95)
    penalties = base | dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
    return shared_engine_rates(model, {"warmup": base, "plain": base, "penalties": penalties, "penalties_dense": penalties, "plain_again": base,
                                       "penalties_again": penalties, "penalties_dense_again": penalties},
                               contexts={"penalties_dense": dense_penalties, "penalties_dense_again": dense_penalties})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--engine", help="also time LLM.generate with and without penalties on this model config (random weights)")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    res = {"benchmark": "penalty_cost", "device": torch.cuda.get_device_name(device), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "versions": {"torch": torch.__version__, "python": platform.python_version()},
           "code_commit": os.environ.get("GIT_COMMIT", "unknown"),  # the device machine's copy of the tree has no history
           "settings": {"vocab": VOCAB, "prompt_tokens": PROMPT, "output_tokens": OUTPUT, "dtype": "bfloat16",
                        "timer": "median of CUDA events around each sampler call (the stream's time, launch gaps included); perf_counter for the host's lists"},
           "rows": [row(B, device) for B in (1, 64, 256)],
           "penalties_alone": [penalties_alone(B, device) for B in (1, 64, 256)]}
    if args.engine: res["engine"] = engine_rates(args.engine)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out: args.out.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
