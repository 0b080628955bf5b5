"Rotary position embeddings (chapter 02): the maths, the llama3 scaling, and agreement with transformers."
import math

import pytest
import torch

from nanoserve.rope import RotaryEmbedding, apply_rope, llama3_scale, rope_inv_freq, rotate_half
from nanoserve.testing import capture, hf_default_model, hf_model, quiet_transformers, tiny_model_dir

quiet_transformers()
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

LLAMA31 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)
# past the tiny Llama's original_max_position_embeddings (64), the tiny models' max (512), SmolLM2's (8192)
POSITIONS = torch.tensor([0, 1, 2, 15, 63, 64, 65, 100, 511, 512, 513, 4000, 8191, 8192, 8193, 20000])


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def ours_for(hf) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim(hf.config), hf.config.rope_parameters["rope_theta"], hf.config.rope_parameters)


def hf_rotate(q, k, cos, sin):
    "transformers' apply_rotary_pos_emb on our (T, H, D) layout; cos/sin (1, T, D)."
    rq, rk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return rq[0].transpose(0, 1), rk[0].transpose(0, 1)


def rope_interleaved(x, positions, inv_freq):
    "RoPE on adjacent pairs (2i, 2i+1), the convention of Meta's original code and llama.cpp."
    angles = positions[:, None].float() * inv_freq
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * torch.polar(torch.ones_like(angles), angles)[:, None]).flatten(-2)


@pytest.fixture(scope="module", params=["llama", "qwen3", "smollm2"])
def hf(request):
    return hf_default_model() if request.param == "smollm2" else hf_model(tiny_model_dir(request.param))


# --- inverse frequencies -------------------------------------------------------------------------

def test_default_inv_freq_formula():
    inv = rope_inv_freq(64, 1e5)
    assert inv.shape == (32,) and inv.dtype == torch.float32
    expected = torch.tensor([1e5 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)
    torch.testing.assert_close(inv.double(), expected, rtol=1e-6, atol=0)
    assert inv[0] == 1.0 and torch.all(inv[1:] < inv[:-1])


@pytest.mark.parametrize("scaling", [None, {}, {"rope_type": "default"}, {"type": "default"},
                                     {"rope_type": None}, {"rope_type": "default", "rope_theta": 1e5}])
def test_default_spellings_agree(scaling):
    assert torch.equal(rope_inv_freq(64, 1e5, scaling), rope_inv_freq(64, 1e5))


def test_llama3_bands():
    before, after = rope_inv_freq(128, 500000.0), rope_inv_freq(128, 500000.0, LLAMA31)
    wavelen = 2 * math.pi / before
    short, long = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert torch.equal(after[short], before[short])  # fast pairs untouched
    assert torch.equal(after[long], before[long] / 8)  # slow pairs interpolated
    mid = ~short & ~long
    assert mid.any() and torch.all(after[mid] < before[mid]) and torch.all(after[mid] > before[mid] / 8)
    ratio = after / before  # monotone from 1 down to 1/8 as the wavelength grows
    assert torch.all(ratio[1:] <= ratio[:-1])


def test_llama3_continuous_at_band_edges():
    L, factor = 8192, 8.0
    for edge, expected_ratio in ((L / 4, 1.0), (L / 1, 1 / factor)):
        inv = torch.tensor([2 * math.pi / (edge * (1 - 1e-4)), 2 * math.pi / (edge * (1 + 1e-4))], dtype=torch.float64)
        ratio = llama3_scale(inv, factor, 1.0, 4.0, L) / inv
        torch.testing.assert_close(ratio, torch.full_like(ratio, expected_ratio), atol=1e-3, rtol=0)


def test_type_spelling_of_llama3():
    old = {k: v for k, v in LLAMA31.items() if k != "rope_type"} | {"type": "llama3"}
    assert torch.equal(rope_inv_freq(128, 500000.0, old), rope_inv_freq(128, 500000.0, LLAMA31))


def test_unsupported_rope_type_names_it_and_the_supported_ones():
    for scaling in ({"rope_type": "yarn", "factor": 4.0}, {"type": "linear", "factor": 2.0}):
        with pytest.raises(ValueError) as e:
            rope_inv_freq(64, 1e4, scaling)
        name = scaling.get("rope_type") or scaling["type"]
        assert name in str(e.value) and "default" in str(e.value) and "llama3" in str(e.value)


def test_llama3_missing_key():
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        rope_inv_freq(64, 1e4, {k: v for k, v in LLAMA31.items() if k != "original_max_position_embeddings"})


@pytest.mark.parametrize("bad", [0, 7, -2])
def test_head_dim_must_be_even_and_positive(bad):
    with pytest.raises(ValueError, match="head_dim"):
        rope_inv_freq(bad, 1e4)


# --- tables and rotation -------------------------------------------------------------------------

def test_tables_shape_dtype_and_duplicated_halves():
    cos, sin = RotaryEmbedding(16, 1e4)(torch.arange(10))
    assert cos.shape == sin.shape == (10, 16) and cos.dtype == sin.dtype == torch.float32
    assert torch.equal(cos[:, :8], cos[:, 8:]) and torch.equal(sin[:, :8], sin[:, 8:])
    assert torch.equal(cos[0], torch.ones(16)) and torch.equal(sin[0], torch.zeros(16))


def test_inv_freq_is_a_non_persistent_buffer_that_stays_float32():
    rope = RotaryEmbedding(64, 1e5)
    assert "inv_freq" in dict(rope.named_buffers()) and rope.state_dict() == {}
    cast = RotaryEmbedding(64, 1e5).to(torch.bfloat16)
    assert cast.inv_freq.dtype == torch.float32 and torch.equal(cast.inv_freq, rope.inv_freq)
    torch.nn.Sequential(cast).half()  # also when cast as part of a bigger model
    assert cast.inv_freq.dtype == torch.float32


def test_rotate_half_is_a_quarter_turn():
    x = torch.arange(8.0)
    assert torch.equal(rotate_half(x), torch.tensor([-4.0, -5, -6, -7, 0, 1, 2, 3]))
    assert torch.equal(rotate_half(rotate_half(x)), -x)


def test_apply_rope_identity_at_zero_and_norm_preserving():
    rope = RotaryEmbedding(32, 1e4)
    x = torch.randn(6, 3, 32, generator=torch.Generator().manual_seed(0))
    cos, sin = rope(torch.tensor([0, 1, 5, 100, 1000, 70000]))
    y = apply_rope(x, cos, sin)
    assert y.shape == x.shape
    torch.testing.assert_close(y[0], x[0])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


def test_pair_is_rotated_by_position_times_frequency():
    D, m = 8, 3
    rope = RotaryEmbedding(D, 1e4)
    x = torch.zeros(1, 1, D); x[..., 1] = 1.0  # unit vector on the first coordinate of pair 1
    y = apply_rope(x, *rope(torch.tensor([m])))[0, 0]
    angle = m * rope.inv_freq[1]
    torch.testing.assert_close(y[[1, 1 + D // 2]], torch.stack([angle.cos(), angle.sin()]))
    assert y[[0, 2, 3, 4, 6, 7]].abs().max() == 0


def test_scores_depend_only_on_offset():
    rope = RotaryEmbedding(64, 1e5)
    q, k = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(1)).unbind(0)

    def score(m, n):
        r = apply_rope(torch.stack([q, k]), *rope(torch.tensor([m, n])))[:, 0]
        return (r[0] @ r[1]).item()

    ref = score(0, 3)
    for m in (1, 10, 100, 1000):
        assert abs(score(m, m + 3) - ref) < 1e-4
    assert abs(score(0, 4) - ref) > 1e-2  # a different offset is a different score


def test_apply_rope_keeps_dtype():
    cos, sin = RotaryEmbedding(16, 1e4)(torch.arange(4))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert apply_rope(torch.randn(4, 2, 16).to(dtype), cos, sin).dtype == dtype


# --- against transformers ------------------------------------------------------------------------

def test_inv_freq_and_tables_match_transformers(hf):
    ours = ours_for(hf)
    assert torch.equal(ours.inv_freq, hf.model.rotary_emb.inv_freq)
    ref_cos, ref_sin = hf.model.rotary_emb(torch.zeros(1), POSITIONS[None])
    cos, sin = ours(POSITIONS)
    assert ref_cos.shape == (1, len(POSITIONS), head_dim(hf.config))
    assert (cos - ref_cos[0]).abs().max() < 1e-5 and (sin - ref_sin[0]).abs().max() < 1e-5


def test_apply_rope_matches_apply_rotary_pos_emb(hf):
    cfg, D = hf.config, head_dim(hf.config)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(POSITIONS), cfg.num_attention_heads, D, generator=g)
    k = torch.randn(len(POSITIONS), cfg.num_key_value_heads, D, generator=g)
    ref_q, ref_k = hf_rotate(q, k, *hf.model.rotary_emb(torch.zeros(1), POSITIONS[None]))
    cos, sin = ours_for(hf)(POSITIONS)
    assert (apply_rope(q, cos, sin) - ref_q).abs().max() < 1e-5
    assert (apply_rope(k, cos, sin) - ref_k).abs().max() < 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # SmolLM2's full forward is slow; the chapter shows it
def test_position_embeddings_seen_by_attention(arch):
    hf = hf_model(tiny_model_dir(arch))
    ids = torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(0))
    call = capture(hf, ids, ["model.layers.0.self_attn"])["model.layers.0.self_attn"]
    ref_cos, ref_sin = call.kwargs["position_embeddings"]
    cos, sin = ours_for(hf)(torch.arange(len(ids)))
    assert (cos - ref_cos[0]).abs().max() < 1e-5 and (sin - ref_sin[0]).abs().max() < 1e-5


def test_bf16_matches_transformers_bit_for_bit(hf):
    cfg, D = hf.config, head_dim(hf.config)
    q = torch.randn(len(POSITIONS), cfg.num_attention_heads, D, generator=torch.Generator().manual_seed(0)).bfloat16()
    ref_q, _ = hf_rotate(q, q, *hf.model.rotary_emb(torch.zeros(1, dtype=torch.bfloat16), POSITIONS[None]))
    assert torch.equal(apply_rope(q, *ours_for(hf)(POSITIONS)), ref_q)


# --- traps: the checks above can fail ------------------------------------------------------------

def test_trap_ignoring_llama3_scaling():
    hf = hf_model(tiny_model_dir("llama"))
    ref_cos, _ = hf.model.rotary_emb(torch.zeros(1), POSITIONS[None])
    unscaled_cos, _ = RotaryEmbedding(head_dim(hf.config), hf.config.rope_parameters["rope_theta"])(POSITIONS)
    assert (unscaled_cos - ref_cos[0]).abs().max() > 0.5


def test_trap_interleaved_convention_differs_until_permuted():
    D = 64
    rope = RotaryEmbedding(D, 1e5)
    q = torch.randn(len(POSITIONS), 3, D, generator=torch.Generator().manual_seed(0))
    ref_q, _ = hf_rotate(q, q, *(t[None] for t in rope(POSITIONS)))
    assert (rope_interleaved(q, POSITIONS, rope.inv_freq) - ref_q).abs().max() > 0.5
    perm = torch.arange(D).view(2, D // 2).t().flatten()  # coordinate i -> 2i, i + D/2 -> 2i + 1
    torch.testing.assert_close(rope_interleaved(q[..., perm], POSITIONS, rope.inv_freq), ref_q[..., perm])


def test_trap_float32_compute_is_not_transformers_bf16():
    "Computing in float32 and casting once is a valid choice, but it does not reproduce transformers' bf16."
    rope = RotaryEmbedding(64, 1e5)
    q = torch.randn(len(POSITIONS), 9, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    cos, sin = rope(POSITIONS)
    ref_q, _ = hf_rotate(q, q, cos[None].bfloat16(), sin[None].bfloat16())
    fp32 = (q.float() * cos[:, None] + rotate_half(q.float()) * sin[:, None]).bfloat16()
    assert (fp32 != ref_q).sum() > 0 and torch.equal(apply_rope(q, cos, sin), ref_q)
