"""Check an lm-evaluation-harness run against nanoserve's server (chapter 12c): every log likelihood it reported for a
multiple-choice task equals transformers' on the default model (float32, CPU). Prints JSON.

    nanoserve serve --port 8000 &
    lm_eval --model local-completions --tasks tiny_mc --include_path benchmarks/lm_eval --log_samples --output_path out \\
        --model_args base_url=http://127.0.0.1:8000/v1/completions,model=SmolLM2-135M-Instruct,num_concurrent=4
    python benchmarks/lm_eval_check.py out/SmolLM2-135M-Instruct/samples_tiny_mc_*.jsonl
"""
import json, sys

import torch

from nanoserve.testing import hf_default_model
from nanoserve.tokenizer import load_tokenizer


def main(path: str):
    hf, tok, rows = hf_default_model(), load_tokenizer(), []
    for line in open(path):
        sample = json.loads(line)
        for arg, resp in zip(sample["arguments"].values(), sample["resps"]):
            context, answer = arg["arg_0"], arg["arg_1"]
            ids, start = tok.encode(context + answer, add_special_tokens=False), len(tok.encode(context, add_special_tokens=False))
            with torch.no_grad(): logp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            reference = sum(logp[p - 1, ids[p]].item() for p in range(start, len(ids)))
            rows.append({"context": context, "answer": answer, "lm_eval": float(resp[0][0]), "transformers": reference})
    worst = max(abs(r["lm_eval"] - r["transformers"]) for r in rows)
    print(json.dumps({"samples": path, "answers": len(rows), "max_abs_diff": worst, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
