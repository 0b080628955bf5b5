"""What structured output (chapter 6c) costs the engine: output tokens/s with every, half or no request constrained; print JSON.

The measure is the time of an engine step (a run's seconds over its steps). A constrained request adds host work to each step (its mask: a cached bool row per DFA state, a fresh vocabulary walk
for a new state; the rows stacked and copied to the device; the state advanced by each token) and takes away the
overlap of async scheduling (chapter 11b): a step that holds a constrained sequence whose last token is still in flight
waits for it before it can make the mask. This runs LLM.generate on the same prompts three ways: every request with a
JSON schema, every request with a regex, every other request with the schema; at two batch sizes. Each is compared with
its free twin: the same requests without constraints, each made to produce exactly as many tokens as it did
constrained (max_tokens = that count, ignore_eos), so that both runs have the same steps with the same rows. Before timing, greedy outputs of the schema run with async scheduling on and
off are compared token for token (they must be equal) and checked against the schema's regex.

    python benchmarks/structured_cost.py --model DIR --load-format dummy --out benchmarks/results/structured_cost_h200.json

DIR needs config.json and the tokenizer's files (weights only without --load-format dummy); the default is the
built-in SmolLM2-135M-Instruct.
"""
import argparse, datetime, re, sys, time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import paged_attention as pa  # noqa: E402  (its commit helper and JSON writer)
from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.structured import StructuredOutputs  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                                           "email": {"type": "string", "format": "uuid"},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8}},
          "required": ["name", "age", "tags"]}
REGEX = r"[A-Z][a-z]{2,12}( [a-z]{1,12}){5,40}\."
KV_BLOCKS = 4096  # 65,536 positions: every request of the largest batch fits; a fixed pool, so that engines made one after another fit too
SPECS = {"json schema": StructuredOutputs(json=SCHEMA), "regex": StructuredOutputs(regex=REGEX)}


def prompts(n: int) -> list:
    return [f"Describe person number {i} of the registry as a JSON object with their name, age and tags." for i in range(n)]

def params_for(mode: str, n: int, max_tokens: int, temperature: float) -> list:
    "Per request: its SamplingParams under `mode` (a key of SPECS, or 'half': every other request with the schema, the rest free)."
    specs = [SPECS["json schema"] if i % 2 == 0 else None for i in range(n)] if mode == "half" else [SPECS[mode]] * n
    return [SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens, structured_outputs=s) for i, s in enumerate(specs)]

def timed(llm: LLM, ps: list, params: list) -> dict:
    "One LLM.generate run: seconds, output tokens and the engine's step phases."
    engine = llm.llm_engine
    before, steps = dict(engine.step_seconds), engine.scheduler.num_steps
    t0 = time.perf_counter()
    outs = llm.generate(ps, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens, steps = sum(len(o.token_ids) for o in outs), engine.scheduler.num_steps - steps
    phases = {k: round(v - before.get(k, 0.0), 4) for k, v in engine.step_seconds.items()}
    return {"seconds": seconds, "output_tokens": tokens, "steps": steps, "ms_per_step": 1e3 * seconds / steps,
            "tokens_per_s": tokens / seconds, "step_phases_s": phases}

def check_equal(model: str, load_format: str, dtype, device: str, n: int = 16, max_tokens: int = 96) -> dict:
    "Greedy schema outputs, async scheduling on and off: equal token ids, and texts that the schema's regex matches."
    spec = SPECS["json schema"]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)] * n
    runs = {}
    for overlap in (False, True):
        llm = LLM(model, load_format=load_format, dtype=dtype, device=device, max_model_len=1024, num_kv_blocks=KV_BLOCKS,
                  async_scheduling=overlap)
        runs[overlap] = llm.generate(prompts(n), params, use_tqdm=False)
        del llm
    pattern = re.compile(spec.pattern(), re.DOTALL)
    finished = [o for o in runs[False] if o.finish_reason == "stop"]
    return {"async_equals_sync": [o.token_ids for o in runs[False]] == [o.token_ids for o in runs[True]],
            "finished_outputs_match_the_schema_regex": all(pattern.fullmatch(o.text) for o in finished),
            "finished": len(finished), "requests": n,
            "others_ran_out_of_tokens": all(o.finish_reason == "length" for o in runs[False] if o not in finished)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model directory (default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"))
    p.add_argument("--batches", nargs="+", type=int, default=[8, 128])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda", help="cuda (the measurement); cpu only to try the script")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    res = {"benchmark": "structured_cost", "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           **pa.git_commit(),
           "settings": {"model": args.model or "SmolLM2-135M-Instruct (built in)", "load_format": args.load_format, "dtype": dtype,
                        "max_tokens": args.max_tokens, "temperature": args.temperature, "repeats": args.repeats,
                        "schema": SCHEMA, "regex": REGEX, "engine": "LLM defaults: async scheduling and CUDA graphs on"},
           "versions": {"torch": torch.__version__}}
    res["check"] = check_equal(args.model, args.load_format, dtype, args.device, min(16, max(args.batches)), min(96, args.max_tokens))
    llm = LLM(args.model, load_format=args.load_format, dtype=dtype, device=args.device, max_model_len=1024, num_kv_blocks=KV_BLOCKS)
    rows = []
    for batch in args.batches:
        ps = prompts(batch)
        for mode in ("json schema", "regex", "half"):
            row = {"batch": batch, "mode": mode}
            params = params_for(mode, batch, args.max_tokens, args.temperature)
            lengths = [len(o.token_ids) for o in llm.generate(ps, params, use_tqdm=False)]  # also the warm-up: DFA rows, masks
            twin = [SamplingParams(temperature=args.temperature, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
            for name, ask in (("constrained", params), ("free, same lengths", twin)):
                timed(llm, ps, ask)  # warm-up (graphs; for the constrained run, a second pass over its states)
                runs = [timed(llm, ps, ask) for _ in range(args.repeats)]
                best = min(runs, key=lambda r: r["ms_per_step"])
                row[name] = {"ms_per_step": [round(r["ms_per_step"], 3) for r in runs], "best_ms_per_step": round(best["ms_per_step"], 3),
                             "steps": best["steps"], "output_tokens": best["output_tokens"], "step_phases_s_of_best": best["step_phases_s"]}
            row["step_time_over_free"] = round(row["constrained"]["best_ms_per_step"] / row["free, same lengths"]["best_ms_per_step"], 3)
            pa.log(f"batch {batch} {mode:12s}: {row['constrained']['best_ms_per_step']:7.3f} ms a step against "
                   f"{row['free, same lengths']['best_ms_per_step']:7.3f} free ({row['step_time_over_free']}x), "
                   f"{row['constrained']['steps']} steps, {row['constrained']['output_tokens']} tokens")
            rows.append(row)
    res["runs"] = rows
    pa.emit(res, args.out)


if __name__ == "__main__":
    main()
