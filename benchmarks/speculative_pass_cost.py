"""What a forward pass over k + 1 new tokens costs against one, at batch 1 (chapter 14's premise); print JSON (--out: also write it).

Speculative decoding checks k drafted tokens in the pass that would have produced one token. Where a decode step is
bound by reading the weights, the extra tokens cost little. This times chapter 7's forward_cached (the path of
`nanoserve generate`, which speculates) over 1, 2, 4, 8 and 16 new tokens after a 512-token context, with random
weights of real shapes (load_format="dummy", benchmarks/configs), in bf16 on a CUDA GPU, two ways: "graphed", the
pass captured in a CUDA graph and replayed (triton.testing.do_bench median, L2 flushed): the GPU's own time, which is
what the premise is about; and "eager", launched from Python as `nanoserve generate` runs it (median of CUDA-event
timings of 50 calls), where the launches of ~15 kernels a layer can take longer than the GPU's work.

    python benchmarks/speculative_pass_cost.py --out benchmarks/results/speculative_pass_cost_h200.json
"""
import argparse, datetime, statistics, sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import paged_attention as pa  # noqa: E402  (its commit helper and JSON writer)
from nanoserve.generate import KVCache, forward_cached  # noqa: E402
from nanoserve.loader import load_model  # noqa: E402

MODELS, NEW_TOKENS, CONTEXT, CALLS = ("Llama-3.2-1B", "Qwen3-0.6B", "Llama-3.1-8B"), (1, 2, 4, 8, 16), 512, 50


def step(model, cache: KVCache, ids: torch.Tensor):
    "One pass over `ids` after the context (the cache rolled back to it first)."
    cache.length = CONTEXT
    with torch.no_grad(): forward_cached(model, ids, cache)

def graphed_ms(model, cache: KVCache, new: int) -> float:
    "GPU milliseconds of the pass, replayed from a CUDA graph."
    ids = torch.randint(0, model.config.vocab_size, (new,), device="cuda")
    return pa.bench(pa.graphed(lambda: step(model, cache, ids)))["ms"]

@torch.no_grad()
def eager_ms(model, cache: KVCache, new: int) -> float:
    "Median milliseconds of one forward_cached call over `new` tokens after the context, launched from Python."
    ids = torch.randint(0, model.config.vocab_size, (new,), device="cuda")
    times = []
    for i in range(10 + CALLS):
        cache.length = CONTEXT
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); forward_cached(model, ids, cache); end.record()
        torch.cuda.synchronize()
        if i >= 10: times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    rows = []
    for name in args.models:
        model = load_model(ROOT / "benchmarks" / "configs" / name, dtype=torch.bfloat16, device="cuda", load_format="dummy")
        cache = KVCache(model.config, CONTEXT + max(NEW_TOKENS), torch.bfloat16, "cuda")
        with torch.no_grad(): forward_cached(model, torch.randint(0, model.config.vocab_size, (CONTEXT,), device="cuda"), cache)
        graph = {n: graphed_ms(model, cache, n) for n in NEW_TOKENS}
        eager = {n: eager_ms(model, cache, n) for n in NEW_TOKENS}
        rows.append({"model": name, "weight_gb": sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9,
                     "graphed_ms": graph, "graphed_relative_to_one": {n: graph[n] / graph[1] for n in NEW_TOKENS},
                     "eager_ms": eager, "eager_relative_to_one": {n: eager[n] / eager[1] for n in NEW_TOKENS}})
        pa.log(name, "graphed", {n: round(v, 3) for n, v in graph.items()}, "eager", {n: round(v, 3) for n, v in eager.items()})
        del model, cache
        torch.cuda.empty_cache()
    pa.emit({"benchmark": "speculative_pass_cost", "device": torch.cuda.get_device_name(0), "versions": {"torch": torch.__version__},
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **pa.git_commit(),
             "settings": {"dtype": "bfloat16", "context": CONTEXT, "calls": CALLS, "path": "nanoserve.generate.forward_cached, replayed from a CUDA graph and launched eagerly"},
             "rows": rows}, args.out)


if __name__ == "__main__":
    main()
