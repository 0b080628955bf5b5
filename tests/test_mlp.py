import pytest, torch
from torch import nn
from nanoserve.mlp import MLP
from nanoserve.testing import capture, hf_default_model, hf_model, tiny_hf_model, tiny_model_dir


def ours_like(hf, name) -> MLP:
    "Our MLP with the weights of the reference module `name`, loaded by name (strict)."
    with torch.device("meta"):  # no random init: the weights are replaced anyway
        ours = MLP(hf.config.hidden_size, hf.config.intermediate_size, getattr(hf.config, "mlp_bias", False))
    ours.load_state_dict(hf.get_submodule(name).state_dict(), assign=True)
    return ours


def mlp_calls(hf, ids) -> dict:
    "What every layer's MLP received and returned, from one forward pass of the reference."
    return capture(hf, ids, [f"model.layers.{i}.mlp" for i in range(hf.config.num_hidden_layers)])


def check_mlps(hf, calls):
    assert len(calls) == hf.config.num_hidden_layers
    for name, call in calls.items():
        with torch.no_grad():
            torch.testing.assert_close(ours_like(hf, name)(call.args[0][0]), call.output[0], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def smol():
    hf = hf_default_model()
    return hf, mlp_calls(hf, torch.tensor([1, 504, 3575, 282, 4649, 314, 7042, 30]))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_matches_transformers_tiny(arch):
    hf = hf_model(tiny_model_dir(arch))
    check_mlps(hf, mlp_calls(hf, torch.arange(11) * 7 % 512))


def test_matches_transformers_default_model(smol):
    check_mlps(*smol)


def test_matches_transformers_with_bias():
    hf = tiny_hf_model("llama", mlp_bias=True)
    assert hf.model.layers[0].mlp.up_proj.bias is not None
    check_mlps(hf, mlp_calls(hf, torch.arange(9)))


def test_checkpoint_names_and_shapes():
    shapes = {n: tuple(p.shape) for n, p in MLP(576, 1536).state_dict().items()}
    assert shapes == {"gate_proj.weight": (1536, 576), "up_proj.weight": (1536, 576), "down_proj.weight": (576, 1536)}
    assert set(MLP(8, 12, bias=True).state_dict()) == {f"{p}_proj.{w}" for p in ("gate", "up", "down")
                                                       for w in ("weight", "bias")}


def test_formula_and_leading_dims():
    torch.manual_seed(0)
    mlp = MLP(16, 40)
    x = torch.randn(2, 5, 16)
    g, u, d = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    expected = (torch.sigmoid(x @ g.T) * (x @ g.T) * (x @ u.T)) @ d.T  # silu(a) = a * sigmoid(a)
    with torch.no_grad():
        y = mlp(x)
        assert y.shape == (2, 5, 16)
        torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mlp(x.reshape(10, 16)), y.reshape(10, 16), atol=1e-6, rtol=0)
        assert mlp(torch.randn(0, 16)).shape == (0, 16)  # an empty token stream


def test_tokens_are_independent():
    torch.manual_seed(0)
    mlp, a, b = MLP(32, 64), torch.randn(3, 32), torch.randn(5, 32)
    with torch.no_grad():
        torch.testing.assert_close(mlp(torch.cat([a, b])), torch.cat([mlp(a), mlp(b)]), atol=1e-6, rtol=0)


def test_bf16_keeps_dtype_and_matches_transformers_bitwise():
    from transformers.models.llama.modeling_llama import LlamaMLP
    hf = tiny_hf_model("llama")
    ref = LlamaMLP(hf.config).to(torch.bfloat16)
    ours = MLP(64, 160).to(torch.bfloat16)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        y = ours(x)
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, ref(x))


def test_fused_gate_up_equals_separate(smol):
    hf, calls = smol
    ours = ours_like(hf, "model.layers.2.mlp")
    x = calls["model.layers.2.mlp"].args[0][0]  # (T, E)
    gate_up = nn.Linear(576, 2 * 1536, bias=False)
    with torch.no_grad():
        gate_up.weight.copy_(torch.cat([ours.gate_proj.weight, ours.up_proj.weight]))
        gate, up = gate_up(x).chunk(2, dim=-1)
        torch.testing.assert_close(ours.down_proj(nn.functional.silu(gate) * up), ours(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("size", [0, -3])
@pytest.mark.parametrize("arg", ["hidden_size", "intermediate_size"])
def test_bad_sizes_name_the_argument(arg, size):
    sizes = {**dict(hidden_size=8, intermediate_size=16), arg: size}
    with pytest.raises(ValueError, match=f"{arg}={size}"):
        MLP(**sizes)


# Traps: the check above must be able to fail.

def _layer_call(hf, name="model.layers.1.mlp"):
    return capture(hf, torch.arange(1, 9), [name])[name]


def test_swapping_gate_and_up_is_caught(smol):
    hf, calls = smol
    name = "model.layers.3.mlp"
    call, ref = calls[name], hf.get_submodule(name)
    swapped = MLP(576, 1536)
    swapped.load_state_dict({"gate_proj.weight": ref.up_proj.weight, "up_proj.weight": ref.gate_proj.weight,
                             "down_proj.weight": ref.down_proj.weight})  # same shapes: loads without error
    with torch.no_grad():
        assert (swapped(call.args[0][0]) - call.output[0]).abs().max() > 1e-1


@pytest.mark.parametrize("act", [nn.functional.gelu, torch.relu, lambda v: v], ids=["gelu", "relu", "none"])
def test_wrong_activation_is_caught(act):
    hf = hf_model(tiny_model_dir("llama"))
    call, ours = _layer_call(hf), ours_like(hf, "model.layers.1.mlp")
    x = call.args[0][0]
    with torch.no_grad():
        wrong = ours.down_proj(act(ours.gate_proj(x)) * ours.up_proj(x))
        assert (wrong - call.output[0]).abs().max() > 1e-4


def test_missing_bias_is_caught():
    hf = tiny_hf_model("llama", mlp_bias=True)
    mlp = hf.model.layers[1].mlp
    with torch.no_grad():  # transformers initialises biases to zero, which would hide a missing bias
        for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj): proj.bias.normal_(0.0, 0.1)
    call = _layer_call(hf)
    no_bias = MLP(64, 160)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        no_bias.load_state_dict(hf.get_submodule("model.layers.1.mlp").state_dict())
    no_bias.load_state_dict(hf.get_submodule("model.layers.1.mlp").state_dict(), strict=False)
    with torch.no_grad():
        assert (no_bias(call.args[0][0]) - call.output[0]).abs().max() > 1e-2
