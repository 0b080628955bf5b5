"""Chapter 9b's fused kernels against the PyTorch ops they replace: on CPU under TRITON_INTERPRET=1 (float32 and
float16), on the GPU in bfloat16 (marked `gpu`), and a fused model against the unfused one."""
import pytest
import torch

from nanoserve.fused_ops import fuse_small_ops, merge_linears, rms_norm, rope, silu_and_mul, unfuse_small_ops
from nanoserve.loader import load_model
from nanoserve.norm import RMSNorm
from nanoserve.rope import apply_rope
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
def test_silu_and_mul(dtype):
    g, u = torch.randn(5, 1500, device=DEVICE).to(dtype), torch.randn(5, 1500, device=DEVICE).to(dtype)
    torch.testing.assert_close(silu_and_mul(torch.cat([g, u], -1)), torch.nn.functional.silu(g) * u,
                               atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-5 if dtype == torch.float32 else 1e-2)


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
        again = unfuse_small_ops(model)(ids)
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    assert torch.equal(again, plain) and "forward" not in model.model.norm.__dict__ and "qkv" not in attn.__dict__


def test_bad_arguments():
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight must be \(8,\)"): rms_norm(x, torch.ones(7, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="even D"): rope(torch.randn(2, 1, 7, device=DEVICE), *angles(2, 8))
    with pytest.raises(ValueError, match="cos and sin must be"): rope(torch.randn(2, 1, 8, device=DEVICE), *angles(3, 8))
    with pytest.raises(ValueError, match="even last dim"): silu_and_mul(x[:, :7])
    with pytest.raises(ValueError, match="without bias"): merge_linears(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))


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
