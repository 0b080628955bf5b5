"""Chapter 11c: the workload, its floor, and `nanoserve bench` end to end on a tiny model (CPU)."""
import json
from pathlib import Path

import pytest
import torch

from nanoserve.__main__ import main
from nanoserve.benchmark import matmul_params, random_requests, time_transformers, weight_bytes_per_step, workload_floor
from nanoserve.model import ModelConfig
from nanoserve.testing import tiny_model_dir

CONFIGS = Path(__file__).parent.parent / "benchmarks" / "configs"


def test_random_requests_are_seeded_and_in_range():
    a, b = random_requests(50, (10, 20), (3, 5), 100, seed=1), random_requests(50, (10, 20), (3, 5), 100, seed=1)
    assert a == b and a != random_requests(50, (10, 20), (3, 5), 100, seed=2)
    assert all(10 <= len(p) <= 20 and 3 <= n <= 5 and max(p) < 100 for p, n in a)
    with pytest.raises(ValueError, match="input_len"): random_requests(1, (5, 2))
    shared = random_requests(20, (10, 20), (3, 5), 100, seed=1, prefix_len=7)
    assert all(p[:7] == shared[0][0][:7] and 17 <= len(p) <= 27 for p, _ in shared)
    assert len({tuple(p[7:]) for p, _ in shared}) == 20  # the prefix is shared, the rest is each prompt's own


def test_floor_counts_a_shared_prefix_once():
    cfg = ModelConfig.from_json(CONFIGS / "Llama-3.2-1B")
    reqs = [([0] * 10, 3), ([0] * 4, 2), ([0] * 6, 2)]
    plain, shared = (workload_floor(cfg, torch.bfloat16, reqs, 8, 1e12, 1e15, shared_prefix_len=n) for n in (0, 3))
    attn = 4 * 16 * 32 * 64
    assert plain["prefill_flops"] - shared["prefill_flops"] == 2 * (2 * matmul_params(cfg) * 3 + attn * 6)  # 2 prompts skip 3 tokens
    assert plain["decode_bytes"] == shared["decode_bytes"]  # decode still reads every position


@pytest.mark.parametrize("name, params", [("Llama-3.2-1B", 1.236e9), ("Qwen3-0.6B", 0.596e9), ("Llama-3.1-8B", 8.03e9),
                                          ("Qwen2.5-0.5B", 0.494e9)])
def test_weight_bytes_match_the_published_parameter_counts(name, params):
    cfg = ModelConfig.from_json(CONFIGS / name)
    counted = weight_bytes_per_step(cfg, torch.bfloat16) / 2 + (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    assert counted == pytest.approx(params, rel=0.01)


def test_floor_by_hand():
    cfg = ModelConfig.from_json(CONFIGS / "Llama-3.2-1B")
    reqs = [([0] * 10, 3), ([0] * 4, 2)]  # decode steps: max(3, 2) - 1 = 2
    f = workload_floor(cfg, torch.bfloat16, reqs, max_num_seqs=8, copy_bytes_per_s=1e12, matmul_flops_per_s=1e15)
    kv_per_token = 2 * 16 * 8 * 64 * 2
    kv_reads = (10 + 1) + (10 + 2) + (4 + 1)  # request 1 reads 11 then 12 tokens, request 2 reads 5
    assert f["decode_steps"] == 2 and f["decode_bytes"] == 2 * weight_bytes_per_step(cfg, torch.bfloat16) + kv_per_token * kv_reads
    attn = 4 * 16 * 32 * 64 * (55 + 10)  # sum over prompts of p(p+1)/2
    assert f["prefill_flops"] == 2 * matmul_params(cfg) * 14 + 2 * 2048 * 128256 * 2 + attn
    assert f["seconds"] == pytest.approx(f["decode_bytes"] / 1e12 + f["prefill_flops"] / 1e15)
    one_slot = workload_floor(cfg, torch.bfloat16, reqs, 1, 1e12, 1e15)
    assert one_slot["decode_steps"] == 3  # (3-1) + (2-1) steps when only one sequence runs at a time


def test_bench_throughput_and_latency_cli(tmp_path, capsys):
    d = str(tiny_model_dir("llama"))
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", d, "--device", "cpu", "--num-kv-blocks", "64", "--num-prompts", "5",
                 "--input-len-range", "4", "9", "--output-len-range", "2", "6", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r == json.loads(capsys.readouterr().out)
    assert r["nanoserve"]["output_tokens"] == r["workload"]["output_tokens"] and r["nanoserve"]["output_tokens_per_s"] > 0
    assert r["command"].startswith("nanoserve") and r["engine"]["num_kv_blocks"] == 64 and "floor" not in r  # no GPU, no floor
    assert r["engine"]["enable_prefix_caching"] and r["nanoserve"]["cached_prompt_tokens"] == 0  # the warm-up's blocks are forgotten
    assert main(["bench", "throughput", "--model", d, "--device", "cpu", "--num-kv-blocks", "64", "--num-prompts", "5",
                 "--max-num-seqs", "1", "--prefix-len", "40", "--input-len-range", "4", "9", "--output-len-range", "2", "6"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["workload"]["prefix_len"] == 40 and r["nanoserve"]["cached_prompt_tokens"] == 4 * 32  # 2 blocks, for the last 4
    assert main(["bench", "throughput", "--model", d, "--device", "cpu", "--num-kv-blocks", "64", "--num-prompts", "2",
                 "--prefix-len", "40", "--no-enable-prefix-caching", "--input-len-range", "4", "9", "--output-len-range", "2", "6"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert not r["engine"]["enable_prefix_caching"] and r["nanoserve"]["cached_prompt_tokens"] == 0
    assert main(["bench", "latency", "--model", d, "--device", "cpu", "--num-kv-blocks", "64", "--input-len", "5",
                 "--output-len", "3", "--num-iters", "1"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["benchmark"] == "latency" and r["ms_per_token"] > 0 and len(r["runs"]) == 1


def test_bench_bad_engine_option_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "latency", "--model", str(tiny_model_dir("llama")), "--device", "cpu", "--block-size", "12"])
    assert e.value.code == 2 and "block_size=12" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [(["latency", "--batch-size", "0"], "batch_size=0"),
                                           (["latency", "--num-iters", "0"], "num_iters=0"),
                                           (["latency", "--output-len", "1"], "output_len=1"),
                                           (["throughput", "--num-prompts", "0"], "num_prompts=0"),
                                           (["throughput", "--prefix-len", "-1"], "prefix_len=-1")])
def test_bench_counts_below_one_exit_2(capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        main(["bench", *flags, "--model", "/no/such/model"])  # refused before the model would load
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_transformers_continuous_batching_is_timed_to_the_last_token():
    "transformers' continuous batching on the CPU, tiny model: every request finishes and each output token is counted."
    requests = [([1, 2, 3], 4), ([5, 6], 3), ([7], 5)]
    res = time_transformers(tiny_model_dir("llama"), requests, torch.float32, "cpu")
    assert res["output_tokens"] == 12 and res["seconds"] > 0 and res["output_tokens_per_s"] == pytest.approx(12 / res["seconds"])

