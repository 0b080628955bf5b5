"""Each model config at the engine's defaults and with each engine option: build the engine (random weights), generate
greedy and sampled outputs, and report its token budget, whether it chunks prompts, and its KV blocks; print JSON.

A smoke test of the paths an operator takes with `nanoserve serve MODEL` and no flags. It found that Llama-3.1-8B's
budget without chunked prefill (131,072 tokens, a whole-context step, the default then) overflowed 32-bit offsets in
a fused kernel (chapter 9b), and it measures what that budget costs the KV cache against chunked prefill (chapter
11a's LONG_CONTEXT rule). `build_and_run_s` includes Triton's compilation, which the first run pays: not a timing.

    python benchmarks/engine_defaults.py --out engine_defaults.json [benchmarks/configs/Qwen3-0.6B ...]
"""
import argparse, gc, random, sys, time, traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanoserve import LLM, SamplingParams  # noqa: E402
from paged_attention import emit, git_commit  # noqa: E402

CONFIGS = [str(Path(__file__).parent / "configs" / name) for name in ("Llama-3.2-1B", "Qwen2.5-0.5B", "Qwen3-0.6B", "Llama-3.1-8B")]
OPTIONS = {"defaults": {}, "whole prompts": dict(enable_chunked_prefill=False), "chunked": dict(enable_chunked_prefill=True),
           "fp8 KV cache": dict(kv_cache_dtype="fp8"), "int8 weights": dict(quantization="int8")}
PROMPT_LENS = (1, 5, 17, 300, 3000, 9000, 64, 128)


def run(config: str, options: dict) -> dict:
    "Build the engine, generate greedy (16 tokens) and sampled (n=2, logprobs, prompt logprobs) outputs; what it chose."
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(n)] for n in PROMPT_LENS]
    start = time.perf_counter()
    llm = LLM(config, load_format="dummy", **options)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    sampled = llm.generate(prompts[:4], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, logprobs=2, prompt_logprobs=1,
                                                       n=2, seed=1), use_tqdm=False)
    ok = (all(len(o.outputs[0].token_ids) == 16 for o in greedy) and all(len(c.token_ids) == 8 for o in sampled for c in o.outputs)
          and all(lp is not None for o in sampled for lp in list(o.prompt_logprobs)[1:]))  # every prompt token but the first
    sched = llm.llm_engine.runner.scheduler_config
    return dict(ok=ok, build_and_run_s=round(time.perf_counter() - start, 1), num_kv_blocks=llm.llm_engine.runner.num_blocks,
                max_model_len=sched.max_model_len, max_num_batched_tokens=sched.max_num_batched_tokens,
                chunked_prefill=sched.enable_chunked_prefill)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("configs", nargs="*", default=CONFIGS)
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available(): sys.exit("needs a CUDA GPU")
    rows = {}
    for config in args.configs:
        for name, options in OPTIONS.items():
            try: rows[f"{config} / {name}"] = run(config, options)
            except Exception as e:  # reported, and the next one runs (a CUDA error may end the process instead)
                rows[f"{config} / {name}"] = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}", traceback=traceback.format_exc()[-1500:])
            print(config, name, {k: v for k, v in rows[f"{config} / {name}"].items() if k != "traceback"}, file=sys.stderr, flush=True)
            gc.collect(); torch.cuda.empty_cache()
    emit({"benchmark": "engine_defaults", "device": torch.cuda.get_device_name(), **git_commit(),
          "versions": {"torch": torch.__version__}, "options": OPTIONS, "prompt_lens": PROMPT_LENS,
          "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": rows}, args.out)


if __name__ == "__main__":
    main()
