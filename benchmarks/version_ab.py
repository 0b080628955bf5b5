"""LLM.generate rates of an older nanoserve and of this checkout, alternated in one call, then a smoke test of n and
stop_reason on the GPU path (CUDA graphs, async scheduling), on the Llama-3.2-1B shape with random weights.

    git archive OLD_COMMIT nanoserve | tar -x -C OLD_DIR   # the older package, beside this checkout
    python benchmarks/version_ab.py OLD_DIR               # writes $OUT/session_ab.json ($OUT defaults to /tmp)
    SMOKE_ONLY=1 python benchmarks/version_ab.py          # the smoke test alone: $OUT/session_smoke.json

The subprocesses run from /tmp, so that this checkout's own nanoserve/ does not shadow the one on their path."""
import json, os, subprocess, sys, time

ROOT = os.getcwd()
OUT = os.environ.get("OUT", "/tmp")
CONFIG = f"{ROOT}/benchmarks/configs/Llama-3.2-1B"
VERSIONS = {"old": os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else None, "new": ROOT}
SETTINGS = {"greedy": {"temperature": 0}, "temperature 0.6, top-p 0.9": {"temperature": 0.6, "top_p": 0.9},
            "greedy, logprobs=1": {"temperature": 0, "logprobs": 1}}

RATES = r"""
import json, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2] + "/benchmarks")
import nanoserve
from engine_rates import engine_rates
res = engine_rates(sys.argv[3], json.loads(sys.argv[4]))
res["nanoserve_file"] = nanoserve.__file__
print("RESULT " + json.dumps(res))
"""

SMOKE = r"""
import json, random, sys
sys.path.insert(0, sys.argv[1])
from nanoserve import LLM, SamplingParams
llm = LLM(sys.argv[2], load_format="dummy", max_num_seqs=64, enable_chunked_prefill=False)  # as in the records, and both versions
rng = random.Random(1)
prompts = [[rng.randrange(1000, 100000) for _ in range(rng.randrange(20, 200))] for _ in range(4)]
llm.reset_prefix_cache()  # both runs start from the same cache: prompts found in it would change the batches' shapes
grouped = llm.generate(prompts, SamplingParams(temperature=1.0, seed=5, max_tokens=32, ignore_eos=True, n=3), use_tqdm=False)
llm.reset_prefix_cache()
flat = llm.generate([p for p in prompts for _ in range(3)],
                    [SamplingParams(temperature=1.0, seed=5 + j, max_tokens=32, ignore_eos=True) for _ in prompts for j in range(3)],
                    use_tqdm=False)
same_choices = [[c.token_ids for c in o.outputs] for o in grouped] == [[f.token_ids for f in flat[3 * i:3 * i + 3]] for i in range(4)]
full = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)[0]
t = full.token_ids[5]; k = full.token_ids.index(t)
cut = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop_token_ids=[t]), use_tqdm=False)[0]
checks = {"n=3 choices equal the same requests given one by one": same_choices,
          "stop_token_ids ends at the token's first appearance": cut.token_ids == full.token_ids[:k + 1],
          "stop_reason is the stop token": cut.stop_reason == t and cut.outputs[0].stop_reason == t,
          "a length-limited output has no stop_reason": full.stop_reason is None and full.finish_reason == "length"}
print("RESULT " + json.dumps(checks))
"""

def child(code: str, *args) -> dict:
    run = subprocess.run([sys.executable, "-c", code, *args], cwd="/tmp", capture_output=True, text=True, timeout=400)
    line = next((l for l in run.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None: return {"error": run.stderr[-3000:]}
    return json.loads(line[len("RESULT "):])

def main():
    import torch
    record = {"benchmark": "version A/B: LLM.generate output tokens/s of an older nanoserve (old) and this checkout (new)",
              "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "versions": {"torch": torch.__version__}, "model": "benchmarks/configs/Llama-3.2-1B (random weights, bf16)",
              "workload": "256 requests of 512 random prompt tokens + 256 output tokens, ignore_eos, per setting",
              "settings": SETTINGS, "runs": []}
    for version in (() if os.environ.get("SMOKE_ONLY") else ("old", "new", "old", "new")):
        res = child(RATES, VERSIONS[version], ROOT, CONFIG, json.dumps(SETTINGS))
        record["runs"].append({"version": version, **res})
        print(version, res.get("output_tokens_per_s", res), flush=True)
    record["smoke_new"] = child(SMOKE, ROOT, CONFIG)
    print(record["smoke_new"], flush=True)
    with open(f"{OUT}/session_{'smoke' if os.environ.get('SMOKE_ONLY') else 'ab'}.json", "w") as f: json.dump(record, f, indent=1)

if __name__ == "__main__":
    main()
