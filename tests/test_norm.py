import pytest, torch
from nanoserve.norm import RMSNorm
from nanoserve.testing import capture, hf_default_model, hf_model, tiny_model_dir


def check_norms(hf, ids):
    names = [f"model.layers.{i}.{n}" for i in range(hf.config.num_hidden_layers)
             for n in ("input_layernorm", "post_attention_layernorm")] + ["model.norm"]
    for name, call in capture(hf, ids, names).items():
        ref = hf.get_submodule(name)
        ours = RMSNorm(ref.weight.numel(), hf.config.rms_norm_eps)
        ours.load_state_dict(ref.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(ours(call.args[0][0]), call.output[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_matches_transformers_tiny(arch):
    check_norms(hf_model(tiny_model_dir(arch)), torch.arange(11) * 7 % 512)


def test_matches_transformers_default_model():
    check_norms(hf_default_model(), torch.tensor([1, 504, 3575, 282, 4649, 314, 7042, 30]))


def test_unit_rms_before_gain_and_dtype_kept():
    x = torch.randn(5, 16, dtype=torch.bfloat16) * 3
    y = RMSNorm(16).to(torch.bfloat16)(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float().pow(2).mean(-1), torch.ones(5), atol=2e-2, rtol=0)


def test_bf16_matches_transformers_bitwise():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    ref = LlamaRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    torch.nn.init.normal_(ref.weight, 1.0, 0.3)
    ours = RMSNorm(64, 1e-5).to(torch.bfloat16)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(9, 64, dtype=torch.bfloat16) * 4
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))


def test_forgetting_the_gain_is_caught():
    hf = hf_model(tiny_model_dir("llama"))
    ids = torch.arange(6)
    call = capture(hf, ids, ["model.layers.0.input_layernorm"])["model.layers.0.input_layernorm"]
    no_gain = RMSNorm(64, hf.config.rms_norm_eps)
    with torch.no_grad():
        assert (no_gain(call.args[0][0]) - call.output[0]).abs().max() > 1e-2
