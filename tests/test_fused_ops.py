"""Chapter 9b's fused kernels against the PyTorch ops they replace: on CPU under TRITON_INTERPRET=1 (float32 and
float16), on the GPU in bfloat16 (marked `gpu`), and a fused model against the unfused one."""
import pytest
import torch

from nanoserve import fused_ops
from nanoserve.fused_ops import (add_rms_norm, fuse_small_ops, gemv, linear, logprob_rows, merge_linears, rms_norm, rope,
                                 silu_and_mul, token_logprobs_fused, unfuse_small_ops)
from nanoserve.loader import load_model
from nanoserve.norm import RMSNorm
from nanoserve.rope import apply_rope
from nanoserve.sampling import token_logprobs
from nanoserve.testing import tiny_model_dir

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def angles(T, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.arange(T)[:, None].float() * torch.rand(D // 2, generator=g)[None, :]
    emb = torch.cat([a, a], -1)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (3, 2, 100)])
def test_rms_norm_equals_module(dtype, shape):
    norm = RMSNorm(shape[-1], eps=1e-5).to(DEVICE, dtype)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(shape, device=DEVICE).to(dtype)
    torch.testing.assert_close(rms_norm(x, norm.weight, norm.eps), norm(x), atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, H, D", [(1, 1, 16), (5, 3, 64), (4, 8, 128)])
def test_rope_equals_apply_rope(dtype, T, H, D):
    x = torch.randn(T, H, D, device=DEVICE).to(dtype)
    cos, sin = angles(T, D)
    ours, ref = rope(x, cos, sin), apply_rope(x, cos, sin)
    if dtype == torch.float32: torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    else: assert torch.equal(ours, ref)  # rounded where PyTorch rounds: exactly equal


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_the_merged_heads(dtype):
    T, H, K, D = 5, 4, 2, 64
    heads = torch.randn(T, H + 2 * K, D, device=DEVICE).to(dtype)  # q, k, v heads side by side, as the merged matmul gives them
    cos, sin = angles(T, D)
    expected = torch.cat([apply_rope(heads[:, :H + K].contiguous(), cos, sin), heads[:, H + K:]], 1)
    assert rope(heads[:, :H + K], cos, sin, out=heads[:, :H + K]).data_ptr() == heads.data_ptr()
    torch.testing.assert_close(heads, expected, atol=1e-6, rtol=1e-6)  # rotated in place; v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, E", [(1, 64), (7, 576), (3, 100)])
def test_add_rms_norm_equals_add_then_norm(dtype, T, E):
    norm = RMSNorm(E, eps=1e-5).to(DEVICE, dtype)
    torch.nn.init.normal_(norm.weight)
    x, h = torch.randn(T, E, device=DEVICE).to(dtype), torch.randn(T, E, device=DEVICE).to(dtype)
    total, normed = add_rms_norm(x, h, norm.weight, norm.eps)
    assert torch.equal(total, x + h)  # rounded as the add rounds
    torch.testing.assert_close(normed, norm(x + h), atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-5 if dtype == torch.float32 else 1e-2)
    same, normed_alone = add_rms_norm(x, None, norm.weight, norm.eps)  # nothing pending: a plain norm
    assert same is x and torch.equal(normed_alone, rms_norm(x, norm.weight, norm.eps))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, K", [(1, 16), (7, 300), (300, 1500), (64, 2048 + 8)])
def test_gemv_is_as_close_to_float64_as_f_linear(dtype, N, K):
    w, x = (torch.randn(N, K, device=DEVICE) / K ** 0.5).to(dtype), torch.randn(1, K, device=DEVICE).to(dtype)
    exact = x.double() @ w.double().T
    ours, theirs = linear(x, w), torch.nn.functional.linear(x, w)
    assert ours.shape == theirs.shape == (1, N) and ours.dtype == dtype
    err, their_err = (ours.double() - exact).abs().max().item(), (theirs.double() - exact).abs().max().item()
    scale = (x.double().abs() @ w.double().abs().T).max().item()  # what rounding errors of a dot product scale with
    bound = torch.finfo(dtype).eps * exact.abs().max().item() + 32 * torch.finfo(torch.float32).eps * scale
    assert err <= their_err + bound, (err, their_err, bound)  # float32 sums in another order, one rounding to dtype
    torch.testing.assert_close(linear(x.expand(3, K), w), torch.nn.functional.linear(x.expand(3, K), w))  # rows > 1: F.linear


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    g, u = torch.randn(5, 1500, device=DEVICE).to(dtype), torch.randn(5, 1500, device=DEVICE).to(dtype)
    torch.testing.assert_close(silu_and_mul(torch.cat([g, u], -1)), torch.nn.functional.silu(g) * u,
                               atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R, V", [(5, 9000), (3, 100), (1, 4096), (0, 300)])
def test_logprobs_in_one_pass_equal_the_log_softmax(dtype, R, V):
    "Rows longer and shorter than a block, and exactly one; ties for the best token go to the lowest id, as argmax's do."
    g = torch.Generator().manual_seed(R * V)
    logits = (torch.randn(R, V, generator=g) * 5).to(dtype).to(DEVICE)
    if R >= 3: logits[2, [V - 1, 7, 50]] = logits[2].max() + 1  # a three-way tie, the last one in the row's last block
    targets = torch.randint(0, V, (R,), generator=g).to(DEVICE)
    reference = logits.float().log_softmax(-1)
    lse, chosen, best, best_logprob = logprob_rows(logits, targets)
    torch.testing.assert_close(lse, logits.float().logsumexp(-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(chosen, reference.gather(1, targets[:, None])[:, 0], rtol=0, atol=1e-5)
    assert best.tolist() == logits.float().argmax(-1).tolist()
    torch.testing.assert_close(best_logprob, reference.max(-1).values, rtol=0, atol=1e-5)
    for n in (0, 1, 4):
        plain, fused = token_logprobs(logits, targets, n), token_logprobs_fused(logits, targets, n)
        assert torch.equal(fused.token_ids, targets) and fused.top_token_ids.shape == (R, n)
        torch.testing.assert_close(fused.logprobs, plain.logprobs, rtol=0, atol=1e-5)
        torch.testing.assert_close(fused.top_logprobs, plain.top_logprobs, rtol=0, atol=1e-5)
        picked = reference.gather(1, fused.top_token_ids)  # the top tokens' own log probabilities: equal ones may swap
        torch.testing.assert_close(picked, plain.top_logprobs, rtol=0, atol=1e-5)


def test_logprob_rows_refuses_bad_arguments():
    logits = torch.randn(3, 10, device=DEVICE)
    with pytest.raises(ValueError, match="logits must be a float"): logprob_rows(logits[0], torch.zeros(3, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match=r"token_ids must be \(3,\) long"): logprob_rows(logits, torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"token_ids must be \(3,\) long"): logprob_rows(logits, torch.zeros(2, dtype=torch.long, device=DEVICE))


def test_a_wrong_rotation_is_caught():
    x = torch.randn(3, 2, 16, device=DEVICE)
    cos, sin = angles(3, 16)
    assert not torch.allclose(rope(x, cos, -sin), apply_rope(x, cos, sin), atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_model_equals_unfused(arch):
    model = load_model(tiny_model_dir(arch), device=DEVICE)
    ids = torch.randint(0, 512, (20,), device=DEVICE)
    with torch.inference_mode():
        plain = model(ids)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        fused = fuse_small_ops(model)(ids)
        attn = model.model.layers[0].self_attn
        assert "qkv" in attn.__dict__ and attn.k_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())  # same names, same values
        one, at = ids[:1], torch.tensor([9], device=DEVICE)  # a decode step: one token, GEMVs and the in-place RoPE
        fused_one = model(one, at)
        again = unfuse_small_ops(model)(ids)
        plain_one = model(one, at)
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_one, plain_one, atol=1e-5, rtol=1e-5)
    assert torch.equal(again, plain) and "forward" not in model.model.norm.__dict__ and "qkv" not in attn.__dict__


def test_bad_arguments():
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight must be \(8,\)"): rms_norm(x, torch.ones(7, device=DEVICE), 1e-6)
    for eps in (0, -1e-6, None, "x", True, float("nan")):  # once a Triton error, or NaN for a zero row at 0
        with pytest.raises(ValueError, match="eps="): rms_norm(x, torch.ones(8, device=DEVICE), eps)
        with pytest.raises(ValueError, match="eps="): add_rms_norm(x, x, torch.ones(8, device=DEVICE), eps)
    with pytest.raises(ValueError, match="x must be a float tensor"): rms_norm(x.long(), torch.ones(8, device=DEVICE).long(), 1e-6)
    with pytest.raises(ValueError, match="x must be a float tensor"): rms_norm(x[0, 0], torch.ones(1, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="even D"): rope(torch.randn(2, 1, 7, device=DEVICE), *angles(2, 8))
    with pytest.raises(ValueError, match="cos and sin must be"): rope(torch.randn(2, 1, 8, device=DEVICE), *angles(3, 8))
    with pytest.raises(ValueError, match="even last dim"): silu_and_mul(x[:, :7])
    with pytest.raises(ValueError, match="without bias"): merge_linears(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="x and h must be"): add_rms_norm(x, x[:2], torch.ones(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match=r"weight must be \(8,\)"): add_rms_norm(x, x, torch.ones(7, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="gemv needs"): gemv(x[0], torch.randn(3, 7, device=DEVICE))
    if not (DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 9):
        with pytest.raises(ValueError, match="programmatic dependent launch"): gemv(x[0], torch.randn(3, 8, device=DEVICE), pdl=True)
    with pytest.raises(ValueError, match="out must be"): rope(torch.randn(2, 1, 8, device=DEVICE), *angles(2, 8), out=torch.empty(2, 2, 8, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_with_and_without_fusion():
    from nanoserve import LLM, SamplingParams
    d, params = tiny_model_dir("llama"), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 2, 3], list(range(10, 60)), [7] * 9]
    fused = LLM(d, dtype="bfloat16", num_kv_blocks=256, max_model_len=256)
    plain = LLM(d, dtype="bfloat16", num_kv_blocks=256, max_model_len=256, fuse_ops=False)
    assert "qkv" in fused.llm_engine.model.model.layers[0].self_attn.__dict__
    assert "qkv" not in plain.llm_engine.model.model.layers[0].self_attn.__dict__
    a = [o.token_ids for o in fused.generate(prompts, params, use_tqdm=False)]
    assert a == [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gpu_one_token_step_fused_equals_unfused_in_bf16(arch):
    "A decode step of one sequence runs every one-row kernel (GEMVs, the in-place RoPE, add_rms_norm) in bf16."
    model = load_model(tiny_model_dir(arch), device="cuda", dtype=torch.bfloat16)
    ids, at = torch.tensor([11], device="cuda"), torch.tensor([5], device="cuda")
    with torch.inference_mode():
        plain = model(ids, at).float()
        fused = fuse_small_ops(model)(ids, at).float()
        unfuse_small_ops(model)
    assert "forward" not in model.lm_head.__dict__
    torch.testing.assert_close(fused, plain, atol=3e-2, rtol=3e-2)  # bf16: sums in other orders, a few last-bit roundings


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper or newer GPU")
def test_gpu_gemvs_launched_early_equal_plain_ones_eagerly_and_in_a_graph(check_early_launches):
    "Kernels launched early (PDL) read their inputs only after the kernel before has finished: a long chain of them, bit for bit."
    E, F, dt = 2048, 8192, torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    gain = 1 + torch.randn(E, device="cuda", generator=g).to(dt) / 10
    gate_up = (torch.randn(2 * F, E, device="cuda", generator=g) / E ** 0.5).to(dt)
    down = (torch.randn(E, F, device="cuda", generator=g) / F ** 0.5).to(dt)
    x0 = torch.randn(1, E, device="cuda", generator=g).to(dt)
    cos, sin = (a[1:] for a in angles(2, 64))  # position 1: a real rotation

    def blocks(kept=None):  # with PDL, every kernel here lets the next one start early, and waits for the one before it
        x, h, outs = x0, None, []
        for _ in range(24):
            x, normed = add_rms_norm(x, h, gain, 1e-5)  # rms_norm when h is None
            up = gemv(normed[0], gate_up)
            rope(up.view(1, -1, 64), cos, sin, out=up.view(1, -1, 64))  # in place, as on the merged q/k/v
            act = silu_and_mul(up)
            h = gemv(act, down)[None]
            outs.append(h)
            if kept is not None: kept += [t for t in (x, normed, up, act, h) if t is not x0]
        return torch.cat(outs)

    check_early_launches(blocks, fused_ops)
