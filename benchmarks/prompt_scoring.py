"""Scoring prompts as an evaluation harness does (`prompt_logprobs`, chapter 11a): prompt tokens per second of
LLM.generate with max_tokens=1 and prompt_logprobs=1, against the same prompts without them (what the LM head on every
row costs), transformers' batched forward with a log-softmax over the same weights, and the floor: the prefill's FLOPs,
the LM head on every position included, at the matmul rate measured in the same run. Both read one random-weight
checkpoint, so the run also compares their log probabilities. It also times the log probabilities of 1,024 rows of
logits alone: chapter 6b's log-softmax against chapter 9b's one-pass kernel, with the bytes of the logits over the copy
bandwidth as the limit. Prints JSON.

    python benchmarks/prompt_scoring.py benchmarks/configs/Llama-3.2-1B [--num-prompts 512] [--prompt-len 512] [--out F]
"""
import argparse, json, random, tempfile, time

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.benchmark import _median_seconds, copy_bandwidth, environment, matmul_params, matmul_rate
from nanoserve.fused_ops import token_logprobs_fused
from nanoserve.loader import ModelConfig
from nanoserve.sampling import token_logprobs


def hf_scores(model, prompts: list, batch: int) -> tuple:
    "transformers: (seconds, [per prompt: (log p of each prompt token after the first, the top-1 token there)])."
    scores = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i:i + batch], device="cuda")  # one length: no padding
            logp = model(ids).logits[:, :-1].float().log_softmax(-1)  # (b, L - 1, V)
            chosen = logp.gather(-1, ids[:, 1:, None])[..., 0]
            best = logp.argmax(-1)
            scores += list(zip(chosen.cpu(), best.cpu()))
    torch.cuda.synchronize()
    return time.perf_counter() - start, scores


def timed_generate(llm: LLM, prompts: list, params: SamplingParams) -> tuple:
    "(seconds, the engine's host phases over the call, outputs) of one LLM.generate from a cold prefix cache."
    llm.reset_prefix_cache()
    engine = llm.llm_engine
    before = dict(engine.step_seconds)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, {k: v - before[k] for k, v in engine.step_seconds.items()}, outs


def logprob_kernels(vocab: int, rows: int = 1024) -> dict:
    "Milliseconds of token_logprobs (float32 log-softmax) and token_logprobs_fused on (rows, vocab) bf16 logits."
    logits = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    limit = rows * vocab * logits.element_size() / copy_bandwidth()  # reading the logits once, at copy speed
    res = {"rows": rows, "vocab": vocab, "read_logits_once_ms": limit * 1e3}
    for n in (1, 5):
        for name, fn in (("log_softmax", token_logprobs), ("one_pass", token_logprobs_fused)):
            res[f"{name}_top{n}_ms"] = _median_seconds(lambda: fn(logits, targets, n)) * 1e3
    a, b = token_logprobs(logits, targets, 1), token_logprobs_fused(logits, targets, 1)
    res["max_abs_diff"] = (a.logprobs - b.logprobs).abs().max().item()
    return res


def floor_flops(cfg: ModelConfig, num_prompts: int, length: int) -> int:
    "FLOPs of the prefill of every prompt with the LM head on every position, and causal attention."
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * num_prompts * length * (length + 1) // 2
    return 2 * (matmul_params(cfg) + cfg.hidden_size * cfg.vocab_size) * num_prompts * length + attn


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a directory with the model's config.json (random weights of that shape)")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--hf-batch", type=int, default=16, help="prompts per transformers forward")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    tokens = args.num_prompts * args.prompt_len
    res = {"benchmark": "prompt_scoring", "model": args.model, **environment(),
           "workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "prompt_tokens": tokens,
                        "prompt_logprobs": 1, "max_tokens": 1}}
    with tempfile.TemporaryDirectory() as checkpoint:
        torch.manual_seed(0)
        with torch.device("cuda"):
            hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model), dtype=torch.bfloat16).eval()
        hf.save_pretrained(checkpoint)  # the same weights for both
        hf_scores(hf, prompts[:args.hf_batch], args.hf_batch)  # warm-up
        hf_seconds, reference = hf_scores(hf, prompts, args.hf_batch)
        res["transformers"] = {"seconds": hf_seconds, "prompt_tokens_per_s": tokens / hf_seconds,
                               "batch": args.hf_batch, "version": __import__("transformers").__version__}
        del hf
        torch.cuda.empty_cache()
        llm = LLM(checkpoint, dtype="bfloat16", max_model_len=max(2048, args.prompt_len + 1))
        scored_params, plain_params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), SamplingParams(temperature=0, max_tokens=1)
        timed_generate(llm, prompts[:32], scored_params)  # warm-up: compiles the kernels of eager steps
        runs, phases = {"scored": [], "plain": []}, {}
        for _ in range(2):  # alternated, so that a drift in the machine's speed shows in both
            for name, params in (("scored", scored_params), ("plain", plain_params)):
                seconds, phases[name], outs = timed_generate(llm, prompts, params)
                runs[name].append(seconds)
                if name == "scored": scored = outs
        res["nanoserve"] = {name: {"seconds": min(s), "runs": s, "prompt_tokens_per_s": tokens / min(s),
                                   "last_run_step_seconds": phases[name]} for name, s in runs.items()}
        res["nanoserve"]["scored_over_plain_seconds"] = min(runs["scored"]) / min(runs["plain"])
        diffs, agree, total = [], 0, 0
        for out, (chosen, best) in zip(scored, reference):
            ours = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
            diffs.append((ours - chosen).abs())
            agree += sum(e.top[0][0] == b for e, b in zip(out.prompt_logprobs[1:], best.tolist()))
            total += len(best)
        d = torch.cat(diffs)
        res["check_vs_transformers"] = {"max_abs_logprob_diff": d.max().item(), "mean_abs_logprob_diff": d.mean().item(),
                                        "top1_agreement": agree / total, "positions": total}
        cfg = llm.llm_engine.model.config
        del llm
        torch.cuda.empty_cache()
    res["logprob_kernels"] = logprob_kernels(cfg.vocab_size)
    rate = matmul_rate("cuda", torch.bfloat16)
    flops = floor_flops(cfg, args.num_prompts, args.prompt_len)
    res["floor"] = {"matmul_flops_per_s": rate, "flops": flops, "seconds": flops / rate, "prompt_tokens_per_s": tokens * rate / flops}
    res["fraction_of_floor"] = res["floor"]["seconds"] / res["nanoserve"]["scored"]["seconds"]
    res["speedup_vs_transformers"] = hf_seconds / res["nanoserve"]["scored"]["seconds"]
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f: f.write(text + "\n")


if __name__ == "__main__":
    main()
