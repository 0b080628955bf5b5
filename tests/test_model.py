import json

import pytest, torch
from nanoserve.model import CausalLM, ModelConfig
from nanoserve.testing import hf_default_model, hf_model, tiny_hf_model, tiny_model_dir


def ours_from_hf(hf):
    model = CausalLM(ModelConfig.from_dict(hf.config.to_dict())).eval()
    model.load_state_dict(hf.state_dict(), strict=True)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
def test_logits_match_transformers_tiny(arch):
    hf = hf_model(tiny_model_dir(arch))
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours_from_hf(hf)(ids), hf(ids[None]).logits[0], atol=1e-4, rtol=0)


def test_logits_match_transformers_default_model():
    hf = hf_default_model()
    ids = torch.tensor([1, 504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 6307, 314])
    with torch.no_grad():
        ours, ref = ours_from_hf(hf)(ids), hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_long_positions_beyond_original_context_llama3_scaling():
    # 300 tokens > original_max_position_embeddings=64 of the tiny llama: the scaled frequencies matter
    hf = hf_model(tiny_model_dir("llama"))
    ids = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours_from_hf(hf)(ids), hf(ids[None]).logits[0], atol=1e-4, rtol=0)


def test_config_reads_transformers_4_and_5_keys():
    v5 = ModelConfig.from_json(tiny_model_dir("llama"))
    d = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    params = d.pop("rope_parameters")
    d["rope_theta"] = params.pop("rope_theta")
    d["rope_scaling"] = params
    d["torch_dtype"] = d.pop("dtype", "float32")
    v4 = ModelConfig.from_dict(d)
    assert v4 == v5
    assert v5.rope_scaling["rope_type"] == "llama3" and v5.rope_theta == 500000.0


def test_config_defaults_and_qwen3_flags():
    q = ModelConfig.from_json(tiny_model_dir("qwen3"))
    assert q.qk_norm and q.tie_word_embeddings and q.head_dim == 32 and q.rope_scaling is None
    d = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
         "num_hidden_layers": 1, "num_attention_heads": 2}
    c = ModelConfig.from_dict(d)
    assert c.num_key_value_heads == 2 and c.head_dim == 4 and not c.qk_norm


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GemmaForCausalLM"]}, "LlamaForCausalLM, Qwen3ForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"hidden_size": 0}, "hidden_size=0"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window=0: expected a positive integer or null"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "max_window_layers": 0, "sliding_window": "4k"}, "sliding_window='4k'"),
    ({"num_key_value_heads": 0}, "num_key_value_heads=0"),  # once read as "absent", so as many as the query heads
    ({"hidden_size": True}, "hidden_size=True"),
    ({"num_attention_heads": 0}, "num_attention_heads=0"),  # once a ZeroDivisionError
    ({"num_attention_heads": "4"}, "num_attention_heads='4'"),  # once a TypeError
    ({"rope_scaling": "linear"}, "rope_scaling='linear': expected an object"),  # once an AttributeError
    ({"architectures": "GemmaForCausalLM"}, "architecture 'GemmaForCausalLM' is not supported"),  # once 'G'
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),  # once read as silu, silently
    ({"rope_theta": [1e6]}, r"rope_theta=\[1000000.0\]: expected a positive number"),  # once a TypeError
    ({"rope_parameters": {"rope_theta": 0}}, "rope_theta=0: expected a positive number"),
])
def test_bad_configs_raise_value_error_naming_the_field(change, message):
    d = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, **change}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(d)


def test_a_config_missing_a_key_or_not_json_names_it(tmp_path):
    with pytest.raises(ValueError, match="lacks hidden_size"):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "intermediate_size": 16,
                               "num_hidden_layers": 1, "num_attention_heads": 4})
    with pytest.raises(ValueError, match="must be a JSON object; got a list"):
        ModelConfig.from_dict([1, 2])
    (tmp_path / "config.json").write_text("{'vocab_size': 10}")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_bytes(b'{"vocab_size": "\xff"}')
    with pytest.raises(ValueError, match="config.json is not valid JSON in UTF-8"):
        ModelConfig.from_json(tmp_path)
    d = {"architectures": "LlamaForCausalLM", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
         "num_hidden_layers": 1, "num_attention_heads": 4}
    assert ModelConfig.from_dict(d).architecture == "LlamaForCausalLM"  # one name, not a list, is read too


def _edited_checkpoint(tmp_path, arch, edit, **overrides):
    "A tiny checkpoint whose config.json `edit` rewrote, as some checkpoints on the hub are written."
    from nanoserve.testing import save_tiny_model
    path = save_tiny_model(arch, tmp_path / arch, **overrides)
    d = json.loads((path / "config.json").read_text())
    edit(d)
    (path / "config.json").write_text(json.dumps(d))
    return path

def _theta_in_rope_scaling(d): d["rope_scaling"] = d.pop("rope_parameters")  # a 5.x dict under the 4.x name
def _head_dim_absent(d): del d["head_dim"]  # Qwen3's default is 128, not hidden_size / heads

@pytest.mark.parametrize("arch, edit, overrides", [
    ("qwen3", _theta_in_rope_scaling, {}),  # theta 1e6 once read as 10000
    ("llama", _theta_in_rope_scaling, {}),  # llama3 scaling and its theta in one dict
    ("llama", lambda d: None, {"mlp_bias": True}),  # once "6 unexpected: ...mlp.down_proj.bias"
    ("qwen3", _head_dim_absent, {"head_dim": 128}),  # once "wrong shape: k_norm.weight"
])
def test_config_variants_read_as_transformers_reads_them(tmp_path, arch, edit, overrides):
    from nanoserve.loader import load_model
    path = _edited_checkpoint(tmp_path, arch, edit, **overrides)
    ids = torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(load_model(path, dtype=torch.float32, device="cpu")(ids), hf_model(path)(ids[None]).logits[0],
                                   atol=1e-4, rtol=0)


def test_architecture_defaults_follow_transformers():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    base = {"vocab_size": 10, "hidden_size": 64, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 32}
    for arch, reference in (("LlamaForCausalLM", LlamaConfig(**base)), ("Qwen3ForCausalLM", Qwen3Config(**base)),
                            ("Qwen2ForCausalLM", Qwen2Config(**base)), ("MistralForCausalLM", MistralConfig(**base))):
        ours = ModelConfig.from_dict({"architectures": [arch], **base})
        ref_head_dim = getattr(reference, "head_dim", None) or 64 // 32
        assert (ours.head_dim, ours.max_position_embeddings, ours.num_key_value_heads, ours.sliding_window) == \
            (ref_head_dim, reference.max_position_embeddings, reference.num_key_value_heads, getattr(reference, "sliding_window", None)), arch
    c = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **base, "rope_theta": None, "max_position_embeddings": None})
    assert (c.rope_theta, c.max_position_embeddings) == (10000.0, 2048)  # null reads as absent
    given = {"num_key_value_heads": None, "mlp_bias": True}  # transformers: a null K means K = H; Qwen3's MLP has no bias
    reference = Qwen3Config(**base, **given)
    ours = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], **base, **given})
    assert (ours.num_key_value_heads, ours.mlp_bias) == (reference.num_key_value_heads, False) == (32, False)


def test_input_must_be_one_sequence():
    model = CausalLM(ModelConfig.from_json(tiny_model_dir("qwen3")))
    with pytest.raises(ValueError, match="1-D"):
        model(torch.zeros(2, 3, dtype=torch.long))


def test_tied_head_shares_storage():
    model = CausalLM(ModelConfig.from_json(tiny_model_dir("qwen3")))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = CausalLM(ModelConfig.from_json(tiny_model_dir("llama")))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_wrong_weights_are_caught():
    # the check can fail: a model with another seed's weights is far off
    hf, other = hf_model(tiny_model_dir("llama")), tiny_hf_model("llama", seed=1)
    ids = torch.arange(12)
    with torch.no_grad():
        assert (ours_from_hf(other)(ids) - hf(ids[None]).logits[0]).abs().max() > 1e-2


@pytest.mark.parametrize("arch, overrides, windows", [
    ("mistral", {"sliding_window": 16}, [16, 16]),  # Mistral 7B v0.1: every layer
    ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}, [None, 12]),  # Qwen: from layer 1 on
    ("qwen3", {"use_sliding_window": True, "sliding_window": 20, "max_window_layers": 0}, [20, 20]),
])
def test_sliding_windows_equal_transformers_past_the_window(arch, overrides, windows):
    "Each layer gets its window, and over three windows' length our logits equal transformers'; full attention's would not."
    hf = tiny_hf_model(arch, **overrides)
    assert arch == "mistral" or "sliding_attention" in hf.config.layer_types
    ours = ours_from_hf(hf)
    assert [layer.self_attn.window for layer in ours.model.layers] == windows
    assert ours.config.max_position_embeddings == hf.config.max_position_embeddings  # the window cuts no context
    ids = torch.randint(0, 512, (60,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(): got, want, full = ours(ids), hf(ids[None]).logits[0], ours_from_hf(tiny_hf_model(arch))(ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    first = min(w for w in windows if w)
    torch.testing.assert_close(full[:first], want[:first], atol=1e-4, rtol=0)  # up to the window, full attention is the same
    assert (full[first:] - want[first:]).abs().max() > 1e-3  # past it, the window has let go of the first tokens


def test_sliding_window_keys_are_read_as_transformers_reads_them():
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "max_position_embeddings": 32768}
    def windows(arch, **d):
        c = ModelConfig.from_dict({"architectures": [arch], **base, **d})
        assert c.max_position_embeddings == 32768  # a window never cuts the context
        return [c.window(i) for i in range(c.num_hidden_layers)]
    assert windows("MistralForCausalLM") == [4096, 4096]  # transformers' default window
    assert windows("MistralForCausalLM", sliding_window=None) == [None, None]  # Mistral 7B v0.3: none
    assert windows("Qwen2ForCausalLM", sliding_window=4096) == [None, None]  # the key alone: use_sliding_window is false
    assert windows("Qwen2ForCausalLM", use_sliding_window=True, max_window_layers=1) == [None, 4096]  # layer 1 slides, 4096 wide
    assert windows("Qwen2ForCausalLM", use_sliding_window=True) == [None, None]  # max_window_layers=28: no layer of 2 slides
    assert windows("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=64,
                   layer_types=["sliding_attention", "full_attention"]) == [64, None]  # layer_types decide over max_window_layers
    assert windows("Qwen3ForCausalLM", use_sliding_window=True, sliding_window=64, layer_types=["full_attention"] * 2) == [None, None]
    # transformers nulls the window without use_sliding_window (then its forward fails on a layer typed sliding_attention)
    assert windows("Qwen2ForCausalLM", sliding_window=64, layer_types=["full_attention", "sliding_attention"]) == [None, None]
    assert windows("LlamaForCausalLM", sliding_window=4096) == [None, None]  # Llama has none
    assert windows("MistralForCausalLM", sliding_window=32768) == [None, None]  # a window as long as the context drops nothing
    assert windows("Qwen2ForCausalLM", use_sliding_window=True, max_window_layers=-1) == [4096, 4096]  # every layer, as transformers
    with pytest.raises(ValueError, match="max_window_layers='2'"):
        windows("Qwen2ForCausalLM", use_sliding_window=True, max_window_layers="2")
    with pytest.raises(ValueError, match="layer_types="):
        windows("Qwen2ForCausalLM", use_sliding_window=True, layer_types=["sliding_attention"])  # one name for two layers
    with pytest.raises(ValueError, match="sliding_layers="):
        ModelConfig("LlamaForCausalLM", 10, 8, 16, 2, 2, 2, 4, sliding_window=8, sliding_layers=(2,))
    with pytest.raises(ValueError, match="need a sliding_window"):
        ModelConfig("LlamaForCausalLM", 10, 8, 16, 2, 2, 2, 4, sliding_layers=(0,))


def test_qwen2_has_biases_on_q_k_v_only_whatever_the_config_says():
    c = ModelConfig.from_json(tiny_model_dir("qwen2"))
    assert (c.qkv_bias, c.attention_bias, c.mlp_bias, c.qk_norm) == (True, False, False, False)
    d = {"architectures": ["MistralForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "attention_bias": True, "mlp_bias": True}
    m = ModelConfig.from_dict(d)
    assert (m.qkv_bias, m.attention_bias, m.mlp_bias) == (False, False, False)  # transformers' Mistral reads neither key
