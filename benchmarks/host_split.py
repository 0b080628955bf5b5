"""Wall-clock microseconds per single-stream decode step spent in each host function (prepare_inputs, the copies, the
graph launch, sampling, output processing), async and sync. Prints one JSON line per mode.

    python benchmarks/host_split.py
"""
import time, json, collections
import torch
import nanoserve.model_runner as mr
from nanoserve import LLM, SamplingParams
from nanoserve.benchmark import random_requests
acc = collections.defaultdict(float); cnt = collections.Counter()
def wrap(obj, name, label):
    f = getattr(obj, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[label] += time.perf_counter() - t; cnt[label] += 1; return r
    setattr(obj, name, g)
llm = LLM("benchmarks/configs/Llama-3.2-1B", load_format="dummy", dtype="bfloat16", max_model_len=2048)
eng = llm.llm_engine; R = eng.runner
wrap(mr, "prepare_inputs", "prepare_inputs"); wrap(mr, "_to_device", "to_device"); wrap(mr, "block_table_array", "block_table_array")
wrap(mr, "sample", "sample"); wrap(mr, "_copy_to_host", "copy_to_host")
wrap(R, "forward", "forward"); wrap(R, "replay", "replay")
import torch.cuda.graphs as G
orig = G.CUDAGraph.replay
def rep(self):
    t = time.perf_counter(); orig(self); acc["cudaGraphLaunch"] += time.perf_counter() - t
G.CUDAGraph.replay = rep
wrap(eng.scheduler, "schedule", "schedule"); wrap(eng, "_process", "process")
prompt = random_requests(1, (128, 128), (1, 1), seed=0)[0][0]
params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
for mode in ("async", "sync"):
    eng.async_scheduling = mode == "async"
    llm.generate([prompt], [params], use_tqdm=False)
    acc.clear(); cnt.clear()
    eng.add_request(None, prompt, params)
    for _ in range(8): eng.step()
    acc.clear(); cnt.clear(); torch.cuda.synchronize()
    t = time.perf_counter(); n = 0
    while eng.has_unfinished(): eng.step(); n += 1
    torch.cuda.synchronize(); wall = time.perf_counter() - t
    print(mode, json.dumps({"us_per_step": 1e6 * wall / n, **{k: round(1e6 * v / n, 1) for k, v in acc.items()}}), flush=True)
