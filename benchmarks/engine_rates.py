"""Output tokens per second of LLM.generate on random-weight requests, one rate per named set of SamplingParams fields:
the engine-level numbers of penalty_cost.py and sampler_profile.py (imported by them, not a script of its own)."""
import contextlib, random, time

from nanoserve.sampling import SamplingParams


def engine_rates(model: str, settings: dict, num_requests: int = 256, prompt_len: int = 512, output_len: int = 256,
                 contexts: dict | None = None, **engine_options) -> dict:
    """LLM.generate on `model` (a config, random weights, `engine_options`) with each of settings {name: SamplingParams
    fields}, in order; a setting named in `contexts` ({name: a function that returns a context manager}) runs inside it."""
    from nanoserve import LLM
    engine_options.setdefault("enable_chunked_prefill", False)  # whole prompts, as every record of these rates was measured
    llm = LLM(model, load_format="dummy", **engine_options)  # (the engine's default chunks contexts over 32,768, chapter 11a)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(prompt_len)] for _ in range(num_requests)]
    rates = {}
    for name, fields in settings.items():
        llm.reset_prefix_cache()
        with (contexts or {}).get(name, contextlib.nullcontext)():
            start = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(**fields, max_tokens=output_len, ignore_eos=True), use_tqdm=False)
            rates[name] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
    return {"model": model, "requests": num_requests, "prompt_len": prompt_len, "output_len": output_len,
            "num_kv_blocks": llm.llm_engine.runner.num_blocks, "output_tokens_per_s": rates}
