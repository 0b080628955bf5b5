"""Chapter 9c's int8 weights: the quantizer's error bound, the Triton matmul against the dequantized reference (CPU
under TRITON_INTERPRET=1 in float32/float16, the GPU in bf16, marked `gpu`), whole models against transformers given
the dequantized weights, and the engine's `quantization` option."""
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.fused_ops import fuse_small_ops, unfuse_small_ops
from nanoserve.loader import load_model
from nanoserve.model_runner import EngineConfig
from nanoserve.quantization import (INT8_DEQUANT_ROWS, INT8_TILES, Int8Linear, _dequantize_triton, dequantize_int8, int8_linear,
                                    int8_splits, int8_tile, quantize_int8, quantize_model)
from nanoserve.testing import hf_model, save_tiny_model, tiny_model_dir

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def quantized(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    return quantize_int8((torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g)).to(DEVICE))


def tolerance(dtype) -> float:  # relative to the largest output: float32 sums in another order; fp16/bf16 round x and the output
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


# --- the quantizer -------------------------------------------------------------------------------------------------

def test_quantize_bounds_the_error_by_half_a_step_per_row():
    w = torch.randn(50, 70) * torch.logspace(-4, 1, 50)[:, None]
    w[7] = 0  # a zero row
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == w.shape and s.shape == (50,)
    assert q.abs().max() == 127 and (q[7] == 0).all() and s[7] == 1
    assert ((dequantize_int8(q, s) - w).abs() <= s[:, None] / 2 * (1 + 1e-6)).all()
    assert (q.abs().amax(1)[torch.arange(50) != 7] == 127).all()  # every nonzero row uses the whole range


def test_quantize_refuses_what_it_cannot_code():
    with pytest.raises(ValueError, match=r"non-empty \(N, K\) floating-point"): quantize_int8(torch.ones(4))
    with pytest.raises(ValueError, match=r"non-empty \(N, K\) floating-point"): quantize_int8(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"non-empty \(N, K\) floating-point weight; got \(3, 0\)"): quantize_int8(torch.ones(3, 0))
    with pytest.raises(ValueError, match="inf or NaN"): quantize_int8(torch.tensor([[1.0, float("nan")]]))


def test_dequantize_kernel_equals_pytorch():
    q, s = quantized(33, 1500)  # columns past one program's 1024
    expect = q.cpu().float() * s.cpu()[:, None]
    for dtype in DTYPES:
        torch.testing.assert_close(_dequantize_triton(q, s, dtype).cpu(), expect.to(dtype), rtol=0, atol=0)
        torch.testing.assert_close(dequantize_int8(q, s, dtype).cpu(), expect.to(dtype), rtol=0, atol=0)


def test_int8_inputs_are_checked():
    q, s = quantized(8, 32)
    x = torch.randn(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="qweight must be a contiguous"): int8_linear(x, q.t(), s)
    with pytest.raises(ValueError, match="qweight must be a contiguous"): int8_linear(x, q.float(), s)
    with pytest.raises(ValueError, match="scale must be float32"): int8_linear(x, q, s[:4])
    with pytest.raises(ValueError, match="scale must be float32"): int8_linear(x, q, s.half())
    with pytest.raises(ValueError, match=r"x must be floating point \(\.\.\., 32\)"): int8_linear(x[:, :16], q, s)
    with pytest.raises(ValueError, match="x must be floating point"): int8_linear(x.long(), q, s)
    with pytest.raises(ValueError, match="scale must be float32"): Int8Linear(q, s.double())
    if DEVICE == "cpu" and not __import__("nanoserve.kernels", fromlist=["x"]).interpreting():
        with pytest.raises(ValueError, match="tile and splits choose a Triton kernel"): int8_linear(x, q, s, tile=(16, 32, 64, 4, 2))


# --- the matmul --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 5, 16, 17, 33, 64, 65, 200])  # both sides of every tile's row bound
@pytest.mark.parametrize("N, K", [(48, 64), (37, 100), (130, 300)])  # sizes no tile divides, K past one BLOCK_K
def test_int8_linear_equals_the_dequantized_matmul(dtype, M, N, K):
    q, s = quantized(N, K)
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    ref = x.float() @ dequantize_int8(q, s).T
    out = int8_linear(x, q, s)
    assert out.dtype == dtype and out.shape == (M, N)
    assert (out.float() - ref).abs().max() <= tolerance(dtype) * ref.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_tile_and_the_dequantized_path_agree(dtype):
    "The optimisation (the Triton kernel with each INT8_TILES tile) against the unoptimised path (dequantize, F.linear)."
    q, s = quantized(70, 200)
    x = torch.randn(40, 200, device=DEVICE).to(dtype)
    plain = torch.nn.functional.linear(x.float(), dequantize_int8(q, s)).to(dtype)
    for tile in [tile for _, *tiles in INT8_TILES for tile in tiles]:
        out = int8_linear(x, q, s, tile=tile)
        assert (out.float() - plain.float()).abs().max() <= tolerance(dtype) * plain.float().abs().max(), tile


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_row_gemv_equals_the_tiled_kernel_and_the_dequantized_path(dtype):
    q, s = quantized(70, 3000)  # K past one GEMV tile, and not a multiple of it
    x = torch.randn(1, 3000, device=DEVICE).to(dtype)
    plain = torch.nn.functional.linear(x.float(), dequantize_int8(q, s))
    for out in (int8_linear(x, q, s), int8_linear(x, q, s, tile=int8_tile(1, 70))):
        assert (out.float() - plain).abs().max() <= tolerance(dtype) * plain.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, N, K", [(3, 40, 1000), (20, 70, 700), (1, 33, 520)])
def test_split_k_equals_one_part(dtype, M, N, K):
    "K in parts (float32 partial sums, then one reduction that scales and rounds) against the whole of K in one program."
    q, s = quantized(N, K)
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    tile = (16, 32, 64, 4, 2)
    whole = int8_linear(x, q, s, tile=tile, splits=1).float()
    for splits in (2, 3, 5, 100):  # 100: more parts than tiles, cut to one tile each
        out = int8_linear(x, q, s, tile=tile, splits=splits).float()
        assert (out - whole).abs().max() <= tolerance(dtype) * whole.abs().max(), splits


def test_int8_splits_fill_the_gpu_in_parts_of_whole_tiles():
    assert int8_splits(64, 8192, 256) == 3 and int8_splits(64, 2048, 256) == 2  # the down and o projections at 8 rows
    assert int8_splits(512, 2048, 256) == 1 and int8_splits(10, 512, 256) == 1  # a full grid; K of fewer than 4 tiles per part
    with pytest.raises(ValueError, match="splits=0: expected a positive int"): int8_linear(torch.ones(2, 8, device=DEVICE), *quantized(4, 8), splits=0)


def test_int8_tile_pads_rows_to_what_tl_dot_takes_and_widens_for_wide_matrices():
    assert int8_tile(1, 100)[0] == 16 and int8_tile(20, 100)[0] == 16 and int8_tile(200, 100)[0] == 64
    assert int8_tile(100, 16384)[:2] == (128, 64) and int8_tile(5000, 100)[:2] == (64, 32)


def test_leading_dims_strides_and_empty_inputs():
    q, s = quantized(24, 64)
    x = torch.randn(3, 5, 128, device=DEVICE)[..., ::2]  # (3, 5, 64), not contiguous
    ref = x.float() @ dequantize_int8(q, s).T
    torch.testing.assert_close(int8_linear(x, q, s), ref, rtol=1e-5, atol=1e-5)
    assert int8_linear(torch.randn(0, 64, device=DEVICE), q, s).shape == (0, 24)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 8, 64, 256, INT8_DEQUANT_ROWS - 1, INT8_DEQUANT_ROWS, 2048])
def test_gpu_bf16_on_llama_shapes_and_in_a_cuda_graph(M):
    q, s = quantized(3072, 2048)
    x = torch.randn(M, 2048, device="cuda").bfloat16()
    ref = x.float() @ dequantize_int8(q, s).T
    eager = int8_linear(x, q, s)
    assert (eager.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    static = torch.empty_like(eager)
    int8_linear(x, q, s)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph): static.copy_(int8_linear(x, q, s))
    graph.replay()
    torch.testing.assert_close(static, eager, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper or newer GPU")
def test_gpu_int8_kernels_launched_early_equal_plain_ones_eagerly_and_in_a_graph(check_early_launches):
    "The GEMV, the tiled kernel and its split-K reduction load only the weight before the kernel before them has finished."
    import nanoserve.quantization as quantization
    from nanoserve.fused_ops import rms_norm
    g = torch.Generator(device="cuda").manual_seed(0)
    gain = 1 + torch.randn(2048, device="cuda", generator=g).bfloat16() / 10
    up, down = quantized(4096, 2048), quantized(2048, 4096)
    inputs = {rows: torch.randn(rows, 2048, device="cuda", generator=g).bfloat16() for rows in (1, 8)}

    def chain(kept=None, rows=1):
        x, outs = inputs[rows], []
        for _ in range(12):
            normed = rms_norm(x, gain, 1e-5)
            h = int8_linear(normed, *up)
            x = int8_linear(h, *down)  # 4096 inputs and 2048 outputs: split over K from 2 rows
            outs.append(x)
            if kept is not None: kept += [normed, h, x]
        return torch.cat(outs)

    for rows in (1, 8):  # the GEMV; the tiled kernel, split
        check_early_launches(lambda kept=None: chain(kept, rows), quantization)


# --- a model -----------------------------------------------------------------------------------------------------

def as_transformers(ours, model_dir):
    "transformers' model of `model_dir` with the weights our Int8Linear layers stand for (dequantized, float32)."
    ref = hf_model(model_dir)
    for name, layer in ours.named_modules():  # new parameters: a tied LM head must not overwrite the embedding
        if isinstance(layer, Int8Linear):
            ref.get_submodule(name).weight = torch.nn.Parameter(dequantize_int8(layer.qweight, layer.scale).cpu())
    return ref


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
@pytest.mark.parametrize("fused", [False, True])
def test_quantized_model_equals_transformers_with_the_dequantized_weights(arch, fused):
    d = tiny_model_dir(arch)
    model = load_model(d, device=DEVICE, dtype=torch.float32)
    embedding = model.model.embed_tokens.weight.detach().clone()
    quantize_model(fuse_small_ops(model) if fused else model)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    torch.testing.assert_close(model.model.embed_tokens.weight, embedding, rtol=0, atol=0)  # the embedding is not quantized
    ids = torch.randint(0, 512, (37,))
    with torch.inference_mode(): ours = model(ids.to(DEVICE)).cpu()
    ref = as_transformers(model, d)(ids[None]).logits[0]
    assert (ours - ref).abs().max() < 1e-4


def test_tied_lm_head_gets_its_own_int8_copy():
    d = tiny_model_dir("qwen3")  # tied embeddings
    model = quantize_model(load_model(d, device=DEVICE, dtype=torch.float32))
    assert model.config.tie_word_embeddings and isinstance(model.lm_head, Int8Linear)
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding)


def test_a_bias_stays_and_is_added_after_the_matmul():
    linear = torch.nn.Linear(64, 24).to(DEVICE)
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(5, 64, device=DEVICE)
    expect = torch.nn.functional.linear(x, dequantize_int8(layer.qweight, layer.scale), linear.bias)
    torch.testing.assert_close(layer(x), expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.rows(8, 20)(x), expect[:, 8:20], rtol=1e-5, atol=1e-5)
    model = quantize_model(torch.nn.Sequential(linear))
    assert isinstance(model[0], Int8Linear) and model[0].bias is not None


def test_quantized_weights_take_the_bytes_the_benchmark_floor_counts(tmp_path):
    "Chapter 11c's weight_bytes_per_step(..., 'int8') against the bytes a quantized model holds (tied and untied heads)."
    from nanoserve.benchmark import weight_bytes_per_step
    biased = save_tiny_model("llama", tmp_path / "biased", attention_bias=True, mlp_bias=True)
    for arch, d in [(a, tiny_model_dir(a)) for a in ("llama", "qwen3", "qwen2")] + [("llama with biases", biased)]:
        model = quantize_model(load_model(d, device="cpu", dtype=torch.bfloat16))
        held = sum(t.numel() * t.element_size() for name, t in list(model.named_parameters()) + list(model.named_buffers())
                   if "embed_tokens" not in name and "rotary" not in name)  # a step gathers rows of the embedding; the tied
    # LM head has its own copy; the rotary frequencies are no weight
        assert weight_bytes_per_step(model.config, torch.bfloat16, "int8") == held, arch


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_stacked_weights_are_quantized_once_and_their_parts_are_views(arch):
    model = quantize_model(fuse_small_ops(load_model(tiny_model_dir(arch), device=DEVICE, dtype=torch.float32)))
    attn = model.model.layers[0].self_attn
    stacked = attn.__dict__["qkv_weight"]
    assert isinstance(stacked, Int8Linear) and "qkv_weight" not in attn._modules  # not a second registered copy
    for part in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert part.qweight.untyped_storage().data_ptr() == stacked.qweight.untyped_storage().data_ptr()
        assert (part.bias is None) == (arch == "llama")  # Qwen2's biases stay with the parts, and stacked beside the weight
    assert (attn.qkv_bias is None) == (arch == "llama") and stacked.bias is None  # added once, not twice
    ids = torch.randint(0, 512, (9,), device=DEVICE)
    with torch.inference_mode():
        fused = model(ids)
        unfused = unfuse_small_ops(model)(ids)
    assert (fused - unfused).abs().max() < 1e-4


def test_fusing_after_quantizing_leaves_the_int8_projections_unstacked():
    d = tiny_model_dir("llama")
    model = fuse_small_ops(quantize_model(load_model(d, device=DEVICE, dtype=torch.float32)))
    assert "qkv_weight" not in model.model.layers[0].self_attn.__dict__
    ids = torch.randint(0, 512, (9,))
    with torch.inference_mode(): ours = model(ids.to(DEVICE)).cpu()
    assert (ours - as_transformers(model, d)(ids[None]).logits[0]).abs().max() < 1e-4


# --- the engine ----------------------------------------------------------------------------------------------------

def test_prepare_model_frees_the_float_weights_it_replaces():
    "Fused linear layers hold their own bound forward (a reference cycle): quantizing must not leave their weights alive."
    import gc, weakref
    from nanoserve.model_runner import prepare_model
    model = fuse_small_ops(load_model(tiny_model_dir("llama"), device="cpu", dtype=torch.float32))
    gc.collect()
    old = [weakref.ref(m.weight) for m in model.modules() if type(m) is torch.nn.Linear]
    old += [weakref.ref(layer.qkv_weight) for layer in (l.self_attn for l in model.model.layers)]
    gc.disable()  # only prepare_model's own collection may free them
    try: prepare_model(model, EngineConfig(quantization="int8", fuse_ops=False))
    finally: gc.enable()
    assert len(old) > 10 and not any(ref() is not None for ref in old)


def test_int8_without_triton_is_a_clear_error(monkeypatch):
    import sys
    from nanoserve.model_runner import prepare_model
    monkeypatch.setitem(sys.modules, "nanoserve.quantization", None)  # as an install without triton fails to import it
    with pytest.raises(ValueError, match="quantization='int8' needs the triton package"):
        prepare_model(load_model(tiny_model_dir("llama"), device="cpu"), EngineConfig(quantization="int8"))


def test_engine_option_is_checked():
    with pytest.raises(ValueError, match=r"quantization='int4': expected one of \(None, 'int8'\)"): EngineConfig(quantization="int4")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_int8_engine_generates_what_transformers_does_with_the_dequantized_weights(arch):
    from test_engine import hf_greedy, random_prompts
    d = tiny_model_dir(arch)
    llm = LLM(d, num_kv_blocks=128, device=DEVICE, dtype="float32", quantization="int8")
    outs = llm.generate(random_prompts(), GREEDY, use_tqdm=False)
    hf = as_transformers(llm.llm_engine.model, d)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12, eos_token_id=None) for p in random_prompts()]
