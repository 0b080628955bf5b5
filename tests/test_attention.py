import pytest, torch
import torch.nn.functional as F
import nanoserve.attention as attention_module
from nanoserve.attention import (Attention, causal_attention, causal_attention_naive, causal_attention_weights,
                                 kv_cache_bytes_per_token, visible_keys)
from nanoserve.testing import capture, hf_default_model, hf_model, tiny_hf_model, tiny_model_dir

ATTENTIONS = [causal_attention_naive, causal_attention]


def qkv(T, H, K, D, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(T, H, D, generator=g), torch.randn(T, K, D, generator=g), torch.randn(T, K, D, generator=g)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


# ---- the attention functions ------------------------------------------------------------------

@pytest.mark.parametrize("H,K", [(4, 4), (9, 3), (8, 1), (6, 2)])
@pytest.mark.parametrize("T", [1, 2, 37])
def test_fused_matches_naive(T, H, K):
    q, k, v = qkv(T, H, K, 16)
    out = causal_attention(q, k, v, 0.3)
    assert out.shape == (T, H, 16)
    torch.testing.assert_close(out, causal_attention_naive(q, k, v, 0.3), atol=1e-5, rtol=0)


@pytest.mark.parametrize("T,S,window", [(10, 10, 3), (4, 10, 3), (1, 10, 3), (10, 10, 1), (10, 10, 10), (4, 10, 20), (1, 10, 10)])
def test_a_sliding_window_is_attention_over_the_last_window_keys(T, S, window):
    q, k, v = qkv(S, 9, 3, 16, seed=T + window)
    q = q[-T:]  # the last T of S positions: prefill when T == S, decode when T == 1
    for f in ATTENTIONS:
        out = f(q, k, v, 0.3, window)
        for t in range(T):  # query t (position S - T + t) equals plain attention over keys S - T + t - window + 1 ... S - T + t
            pos = S - T + t
            first = max(0, pos - window + 1)
            torch.testing.assert_close(out[t], causal_attention(q[t:t + 1], k[first:pos + 1], v[first:pos + 1], 0.3)[0],
                                       atol=1e-5, rtol=0, msg=f"{f.__name__} t={t}")
    if window < S: assert (causal_attention(q, k, v, 0.3, window) - causal_attention(q, k, v, 0.3)).abs().max() > 1e-3


def test_visible_keys_and_bad_windows():
    assert visible_keys(3, 5, 2).int().tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert visible_keys(3, 5).int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    q, k, v = qkv(5, 4, 2, 8)
    for window in (0, -1, 1.5, True, "4"):
        for f in ATTENTIONS:
            with pytest.raises(ValueError, match="window="): f(q, k, v, 0.3, window)
        with pytest.raises(ValueError, match="window="): Attention(32, 4, 2, 8, window=window)


def test_the_layer_hands_its_window_to_attend():
    seen = []
    def attend(q, k, v, scale, window=None):
        seen.append(window)
        return causal_attention(q, k, v, scale, window)
    x, cos, sin = torch.randn(6, 32), torch.ones(6, 8), torch.zeros(6, 8)
    for window in (None, 3):
        Attention(32, 4, 2, 8, window=window)(x, cos, sin, attend)
    assert seen == [None, 3]


def test_fallback_without_enable_gqa(monkeypatch):
    q, k, v = qkv(20, 9, 3, 16)
    expected = causal_attention(q, k, v, 0.25)
    monkeypatch.setattr(attention_module, "_SDPA_GQA", False)  # the torch 2.4 path: expand the KV heads first
    torch.testing.assert_close(causal_attention(q, k, v, 0.25), expected, atol=1e-6, rtol=0)


def test_bf16_close_to_fp32():
    q, k, v = qkv(33, 9, 3, 64)
    ref = causal_attention_naive(q, k, v, 0.125)
    for f in ATTENTIONS:
        out = f(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.125)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=0)


def test_weights_are_causal_and_rows_sum_to_one():
    q, k, _ = qkv(12, 6, 2, 8)
    w = causal_attention_weights(q, k, 0.5)
    assert w.shape == (6, 12, 12) and w.dtype == torch.float32
    assert torch.equal(w.triu(1), torch.zeros_like(w))
    torch.testing.assert_close(w.sum(-1), torch.ones(6, 12))
    torch.testing.assert_close(w[:, 0, 0], torch.ones(6))  # the first token sees only itself


@pytest.mark.parametrize("f", ATTENTIONS)
def test_single_token_returns_its_value(f):
    q, k, v = qkv(1, 6, 2, 8)
    torch.testing.assert_close(f(q, k, v, 1.0), v.repeat_interleave(3, dim=1))


@pytest.mark.parametrize("f", ATTENTIONS)
def test_zero_queries_average_the_past(f):
    _, k, v = qkv(10, 4, 2, 8)
    out = f(torch.zeros(10, 4, 8), k, v, 1.0)  # equal scores: uniform weights over positions 0..t
    running_mean = v.cumsum(0) / torch.arange(1, 11)[:, None, None]  # (T, K, D)
    torch.testing.assert_close(out, running_mean.repeat_interleave(2, dim=1))


@pytest.mark.parametrize("f", ATTENTIONS)
def test_shape_errors(f):
    q, k, v = qkv(5, 6, 4, 8)
    with pytest.raises(ValueError, match="H=6.*K=4"): f(q, k, v, 1.0)  # 6 % 4 != 0
    q, k, v = qkv(5, 6, 3, 8)
    with pytest.raises(ValueError, match="expected q"): f(q[0], k, v, 1.0)  # no token axis
    with pytest.raises(ValueError, match="expected q"): f(q, k, v[:, :1], 1.0)  # k and v differ
    with pytest.raises(ValueError, match="T=5"): f(q, k[:3], v[:3], 1.0)  # other lengths: not prefill
    with pytest.raises(ValueError, match="D=8"): f(q, k[..., :4], v[..., :4], 1.0)
    with pytest.raises(ValueError, match="K=0"): f(q, k[:, :0], v[:, :0], 1.0)


def test_kv_cache_bytes_per_token():
    assert kv_cache_bytes_per_token(30, 3, 64) == 23040  # SmolLM2, bf16: 22.5 KiB
    assert kv_cache_bytes_per_token(30, 9, 64) == 3 * 23040  # the same shape as MHA
    assert kv_cache_bytes_per_token(32, 8, 128) == 128 * 2**10  # Llama-3-8B
    assert kv_cache_bytes_per_token(32, 8, 128, torch.float32) == 256 * 2**10


# ---- traps: each wrong version must be caught ---------------------------------------------------

@pytest.mark.parametrize("f", ATTENTIONS)
def test_grouping_repeat_interleave_not_repeat(f):
    q, k, v = qkv(10, 9, 3, 16)
    right = f(q, k, v, 0.25)
    torch.testing.assert_close(f(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), 0.25), right)
    scrambled = f(q, k.repeat(1, 3, 1), v.repeat(1, 3, 1), 0.25)
    assert (scrambled - right).abs().max() > 0.1
    torch.testing.assert_close(scrambled[:, :1], right[:, :1])  # head 0 reads KV head 0 either way


@pytest.mark.parametrize("f", ATTENTIONS)
def test_swapping_q_and_k(f):
    q, k, v = qkv(10, 4, 4, 16)  # MHA: the swap runs, and changes every position but the first
    diff = (f(k, q, v, 0.25) - f(q, k, v, 0.25)).abs()
    assert diff[1:].amax(dim=(1, 2)).min() > 1e-3
    torch.testing.assert_close(diff[0], torch.zeros_like(diff[0]))
    q, k, v = qkv(10, 4, 2, 16)  # GQA: the swap does not even fit
    with pytest.raises(ValueError): f(k, q, v, 0.25)


@pytest.mark.parametrize("f", ATTENTIONS)
def test_future_token_does_not_change_the_past(f):
    q, k, v = qkv(10, 9, 3, 16)
    q2, k2, v2 = qkv(10, 9, 3, 16, seed=1)
    for t in (9, 4):  # change every position from t on
        qa, ka, va = (torch.cat([a[:t], b[t:]]) for a, b in ((q, q2), (k, k2), (v, v2)))
        out, out2 = f(q, k, v, 0.25), f(qa, ka, va, 0.25)
        torch.testing.assert_close(out2[:t], out[:t], atol=0, rtol=0)
        assert (out2[t:] - out[t:]).abs().amax(dim=(1, 2)).min() > 1e-3


def test_attention_without_mask_fails_the_causality_check():
    q, k, v = qkv(10, 9, 3, 16)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    k2[-1], v2[-1] = k2[-1] + 1, v2[-1] + 1
    no_mask = lambda q, k, v: F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in (q, k, v)), enable_gqa=True)
    assert (no_mask(q2, k2, v2)[:, :-1] - no_mask(q, k, v)[:, :-1]).abs().max() > 1e-3


# ---- the layer ----------------------------------------------------------------------------------

def test_layer_errors_and_names():
    with pytest.raises(ValueError, match="num_heads=6.*num_kv_heads=4"): Attention(64, 6, 4, 16)
    with pytest.raises(ValueError, match="num_kv_heads=0"): Attention(64, 6, 0, 16)
    assert set(Attention(64, 4, 2, 16).state_dict()) == {f"{p}_proj.weight" for p in "qkvo"}
    names = set(Attention(64, 4, 2, 16, qk_norm=True, bias=True).state_dict())
    assert names == {f"{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")} | {"q_norm.weight", "k_norm.weight"}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_names_equal_the_checkpoint(arch):
    hf = hf_model(tiny_model_dir(arch))
    ours = attention_from_hf(hf, 0)
    assert set(ours.state_dict()) == set(hf.model.layers[0].self_attn.state_dict())


def test_layer_is_causal_and_keeps_dtype():
    layer = Attention(64, 4, 2, 16, qk_norm=True)
    x = torch.randn(8, 64)
    cos, sin = torch.randn(8, 16).cos(), torch.randn(8, 16).sin()
    x2 = x.clone(); x2[-1] += 1
    with torch.no_grad():
        out, out2 = layer(x, cos, sin), layer(x2, cos, sin)
        assert out.shape == (8, 64)
        torch.testing.assert_close(out2[:-1], out[:-1], atol=0, rtol=0)
        assert (out2[-1] - out[-1]).abs().max() > 1e-4
        assert layer.to(torch.bfloat16)(x.bfloat16(), cos, sin).dtype == torch.bfloat16


def attention_from_hf(hf, i):
    c, ref = hf.config, hf.model.layers[i].self_attn
    ours = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, ref.head_dim,
                     qk_norm=hasattr(ref, "q_norm"), rms_norm_eps=c.rms_norm_eps,
                     bias=ref.o_proj.bias is not None, qkv_bias=ref.q_proj.bias is not None)
    ours.load_state_dict(ref.state_dict())  # strict: every name matches the checkpoint's
    return ours


def check_layers(hf, ids, atol=1e-5):
    names = [f"model.layers.{i}.self_attn" for i in range(hf.config.num_hidden_layers)]
    calls = capture(hf, ids, names)
    for i, name in enumerate(names):
        x, (cos, sin) = calls[name].kwargs["hidden_states"][0], calls[name].kwargs["position_embeddings"]
        assert cos.shape == (1, len(ids), hf.model.layers[i].self_attn.head_dim)
        with torch.no_grad():
            torch.testing.assert_close(attention_from_hf(hf, i)(x, cos[0], sin[0]), calls[name].output[0][0],
                                       atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
def test_matches_transformers_tiny(arch):
    check_layers(hf_model(tiny_model_dir(arch)), torch.arange(13) * 37 % 512)


def test_matches_transformers_with_bias():
    hf = tiny_hf_model("llama", attention_bias=True)
    assert hf.model.layers[0].self_attn.q_proj.bias is not None
    check_layers(hf, torch.arange(9) * 11 % 512)


def test_qwen2_biases_are_on_q_k_and_v_only():
    hf = hf_model(tiny_model_dir("qwen2"))
    attn = hf.model.layers[0].self_attn
    assert attn.q_proj.bias.abs().min() > 0 and attn.o_proj.bias is None  # jittered, so a bias left unloaded shows
    ours = attention_from_hf(hf, 0)
    assert [p.bias is not None for p in (ours.q_proj, ours.k_proj, ours.v_proj, ours.o_proj)] == [True, True, True, False]


def test_matches_transformers_default_model():
    check_layers(hf_default_model(), torch.tensor([1, 504, 3575, 282, 4649, 314, 7042, 30, 378, 1345, 28, 253]))


def test_scrambled_grouping_is_caught_on_the_reference():
    hf = hf_model(tiny_model_dir("llama"))  # H=4, K=2: repeat pairs head 1 with KV head 1 instead of 0
    ids = torch.arange(10) * 13 % 512
    call = capture(hf, ids, ["model.layers.1.self_attn"])["model.layers.1.self_attn"]
    ours = attention_from_hf(hf, 1)
    x, (cos, sin) = call.kwargs["hidden_states"][0], call.kwargs["position_embeddings"]
    with torch.no_grad():
        q, k, v = ours.qkv(x, cos[0], sin[0])
        scrambled = ours.o_proj(causal_attention(q, k.repeat(1, 2, 1), v.repeat(1, 2, 1), ours.scale).flatten(1))
    assert (scrambled - call.output[0][0]).abs().max() > 1e-3


def test_missing_qk_norm_is_caught_on_qwen3():
    hf = hf_model(tiny_model_dir("qwen3"))
    ref = hf.model.layers[0].self_attn
    c = hf.config
    no_norm = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, ref.head_dim)
    no_norm.load_state_dict({k: w for k, w in ref.state_dict().items() if "norm" not in k})
    call = capture(hf, torch.arange(6), ["model.layers.0.self_attn"])["model.layers.0.self_attn"]
    cos, sin = call.kwargs["position_embeddings"]
    with torch.no_grad():
        assert (no_norm(call.kwargs["hidden_states"][0], cos[0], sin[0]) - call.output[0][0]).abs().max() > 1e-3


# ---- GPU tier -----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_matches_naive_on_cuda(dtype):
    q, k, v = qkv(300, 32, 8, 128, dtype=dtype, device="cuda")
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    ref = causal_attention_naive(q.float(), k.float(), v.float(), 128**-0.5)
    out = causal_attention(q, k, v, 128**-0.5)
    assert out.dtype == dtype and out.device.type == "cuda"
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0)
    torch.testing.assert_close(causal_attention_naive(q, k, v, 128**-0.5).float(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("T, S", [(1, 1), (1, 17), (5, 17), (17, 17)])
def test_queries_at_the_end_of_a_longer_past(T, S):
    # a cached past: the T queries are the last T of S positions (chapter 7), mask aligned bottom-right
    g = torch.Generator().manual_seed(T * 100 + S)
    q, k, v = torch.randn(T, 6, 16, generator=g), torch.randn(S, 2, 16, generator=g), torch.randn(S, 2, 16, generator=g)
    fused, naive = causal_attention(q, k, v, 0.25), causal_attention_naive(q, k, v, 0.25)
    torch.testing.assert_close(fused, naive)
    # the same as the last T rows of full prefill over S queries
    full_q = torch.cat([torch.randn(S - T, 6, 16, generator=g), q])
    torch.testing.assert_close(fused, causal_attention(full_q, k, v, 0.25)[S - T:])


def test_fewer_keys_than_queries_is_refused():
    with pytest.raises(ValueError, match="at least its T=5"):
        causal_attention(torch.randn(5, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8), 1.0)
