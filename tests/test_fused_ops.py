"""Chapter 9b's fused kernels against the PyTorch ops they replace: on CPU under TRITON_INTERPRET=1 (float32 and
float16), on the GPU in bfloat16 (marked `gpu`), and a fused model against the unfused one."""
import dataclasses

import pytest
import torch

from nanoserve import fused_ops
from nanoserve.fused_ops import (add_rms_norm, apply_penalties_fused, fuse_small_ops, gemv, linear, logprob_rows, merge_biases, merge_linears,
                                 rms_norm, rope, search_filter, silu_and_mul, token_logprobs_fused, unfuse_small_ops)
from nanoserve.loader import load_model
from nanoserve.norm import RMSNorm
from nanoserve.rope import apply_rope
from nanoserve.sampling import SamplingParams, TokenHistory, apply_penalties, filter_logits, make_generator, sample, token_logprobs
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


def filter_rows(B, V, seed, dtype):
    "Logits with many ties, banned tokens and a row with one token left, and each row's temperature, top-k, top-p and min-p."
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=g) * 4).round(decimals=1)
    logits[:1, ::3] = float("-inf")
    logits[1:2, 1:] = float("-inf")  # one token that can be drawn
    temperature = torch.rand(B, generator=g) + 0.3
    top_k = torch.where(torch.rand(B, generator=g) < 0.5, V, torch.randint(1, V + 1, (B,), generator=g))
    top_k[:1] = V - V // 4  # past the finite logits: the -inf ones tie for the k-th
    top_p = torch.rand(B, generator=g)
    top_p[2:6] = torch.tensor([1.0, 0.0, 1e-30, 0.99])[:max(0, min(4, B - 2))]
    min_p = torch.where(torch.rand(B, generator=g) < 0.5, 0.0, torch.rand(B, generator=g) * 0.3)
    min_p[-1:] = 1.0  # only the ties of the best token
    return (t.to(DEVICE) for t in (logits.to(dtype), temperature, top_k, top_p, min_p))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, V, seed", [(8, 3000, 0), (7, 9001, 1), (3, 100, 2), (2, 1, 3), (8, 8192, 4), (0, 50, 5)])
def test_search_filter_keeps_what_filter_logits_keeps(dtype, B, V, seed):
    "Rows shorter and longer than a block, and exactly one; ties, -inf, top_k 1 and V, top_p 0 and 1, min_p 1: bit for bit."
    logits, temperature, top_k, top_p, min_p = filter_rows(B, V, seed, dtype)
    found = search_filter(logits, temperature, top_k, top_p, min_p)
    assert found.dtype == torch.float32 and found.shape == (B, V)
    assert torch.equal(found, filter_logits(logits.float() / temperature[:, None], top_k, top_p, min_p))
    alone = (torch.full_like(top_k, V), torch.ones_like(top_p), torch.zeros_like(min_p))  # top-k, top-p and min-p each alone
    for i, each in enumerate([(top_k, *alone[1:]), (alone[0], top_p, alone[2]), (*alone[:2], min_p)]):
        assert torch.equal(search_filter(logits, temperature, *each), filter_logits(logits.float() / temperature[:, None], *each)), i


def test_search_filter_reads_strided_rows_of_parameters():
    "SamplingTensors' columns are views with a stride: read in place, with no copy, as the contiguous ones are."
    logits, temperature, top_k, top_p, min_p = filter_rows(5, 3000, 11, torch.float32)
    table = torch.stack([temperature, top_k.float(), top_p, min_p], dim=1)  # (B, 4): each column a strided view
    strided = (table[:, 0], table[:, 1].long(), table[:, 2], table[:, 3])
    assert table[:, 0].stride(0) == 4
    assert torch.equal(search_filter(logits, *strided), search_filter(logits, temperature, top_k, top_p, min_p))


def thresholds_within_rounding(row: torch.Tensor, k: int, p: float, slack: float = 1e-6) -> set:
    """The top-k and top-p thresholds a float32 filter may find for `row`: the float64 one by the definition, and its
    neighbour among the row's values where the decision lies within `slack` of the mass (float32 sums in any order)."""
    x = row.double()
    values = x.unique(sorted=True).flip(0).tolist()  # distinct, largest first
    kth = x.sort(descending=True).values[min(k, len(x)) - 1].item()
    w = (x - x.max()).exp()
    total = w[x >= kth].sum().item()
    margin = {v: w[x > v].sum().item() - p * total for v in values if v >= kth}  # < 0: kept
    exact = min(v for v, m in margin.items() if m < 0) if p < 1 else kth
    allowed, i = {exact}, values.index(exact)
    if i + 1 < len(values) and values[i + 1] in margin and abs(margin[values[i + 1]]) < slack * total: allowed.add(values[i + 1])
    if i > 0 and abs(margin[exact]) < slack * total: allowed.add(values[i - 1])
    return allowed


def test_search_filter_at_a_cut_within_float32_rounding():
    "Chapter 6b's review case, where the mass above a tie sits within float32 rounding of top-p: either side, never further."
    row = ((torch.randn(4, 5000, generator=torch.Generator().manual_seed(0)) * 0.3) * 8).round()[0] / 8  # many ties
    logits, ones = row.repeat(4, 1).to(DEVICE), torch.ones(4, device=DEVICE)
    for top_k in (50, 5000):
        for top_p in (0.023509737104177475, 0.5, 0.9, 0.999999):
            k, p = torch.full((4,), top_k, device=DEVICE), torch.full((4,), top_p, device=DEVICE)
            found = search_filter(logits, ones, k, p, 0 * ones)
            assert (found == found[:1]).all()  # the same row four times: the same cut
            threshold = found[0][torch.isfinite(found[0])].min().item()
            assert threshold in thresholds_within_rounding(row, top_k, p[0].item()), (top_k, top_p)


def test_search_filter_ties_what_filter_logits_ties():
    "Two float32 logits that x / T rounds to one value, and -0 beside +0, tie for top-k 1 as they do after the division."
    t = torch.tensor(0.7)
    x = torch.tensor(1.5) + torch.arange(64) * torch.finfo(torch.float32).eps  # neighbouring float32 values
    i = int(((x[1:] / t) == (x[:-1] / t)).nonzero()[0])  # the first pair that dividing by T merges
    merged = [x[i].item(), x[i + 1].item(), 0.5, -1.0]
    signed = [0.0, -0.0, -1.0, -2.0]
    for row, t in ((merged, t.item()), (signed, 1.0), (signed, 0.3)):
        for dtype in ((torch.float32,) if row is merged else (torch.float32, torch.float16)):
            logits = torch.tensor([row, row], dtype=dtype, device=DEVICE)
            temperature, top_k = torch.full((2,), t, device=DEVICE), torch.tensor([1, 4], device=DEVICE)
            top_p, min_p = torch.tensor([1.0, 0.3], device=DEVICE), torch.zeros(2, device=DEVICE)
            found = search_filter(logits, temperature, top_k, top_p, min_p)
            assert torch.equal(found, filter_logits(logits.float() / temperature[:, None], top_k, top_p, min_p))
            assert torch.isfinite(found[0]).sum() == 2  # both kept


def test_search_filter_refuses_bad_arguments():
    logits, rows = torch.randn(3, 10, device=DEVICE), torch.ones(3, device=DEVICE)
    with pytest.raises(ValueError, match="logits must be a"): search_filter(logits[0], rows, rows, rows, rows)
    with pytest.raises(ValueError, match="logits must be a"): search_filter(logits.double(), rows, rows, rows, rows)
    with pytest.raises(ValueError, match=r"top_p must hold one value per row, \(3,\)"): search_filter(logits, rows, rows, rows[:2], rows)


def test_sample_with_the_search_filter_draws_what_sorting_draws():
    "Seeded rows draw the same tokens, with top-k, a bias (a float32 copy) or penalties; a batch with no filter never calls it."
    logits = (torch.randn(12, 3000, generator=torch.Generator().manual_seed(6)) * 3).to(torch.float16 if DEVICE == "cpu" else torch.bfloat16).to(DEVICE)
    settings = [(0.7, 0, 0.9, 0), (1.3, 40, 0.5, 0), (1.0, 0, 0.95, 0.05), (0, 5, 0.3, 0), (2.0, 0, 1.0, 0.2), (0.9, 1, 0.8, 0)] * 2
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=s, logit_bias={5: 2.0} if s == 7 else None)
              for s, (t, k, p, m) in enumerate(settings)]
    calls = []
    def counted(*args):
        calls.append(args[0].dtype); return search_filter(*args)
    draw = lambda search, ps=params, history=None: sample(logits, ps, [make_generator(p.seed, DEVICE) for p in ps], history,
                                                           search_filter=search).token_ids
    assert torch.equal(draw(counted), draw(None)) and calls == [torch.float32]  # the bias made a float32 copy
    unbiased = [dataclasses.replace(p, logit_bias=None) for p in params]
    assert torch.equal(draw(counted, unbiased), draw(None, unbiased)) and calls[-1] == logits.dtype  # the model's own logits
    penalized = [dataclasses.replace(p, presence_penalty=0.5) for p in unbiased]
    history = TokenHistory.from_lists([[1, 2]] * 12, [[3]] * 12, DEVICE)
    assert torch.equal(draw(counted, penalized, history), draw(None, penalized, history)) and len(calls) == 3
    banned = [(5, 17)] * 12  # min_tokens' bans: a float32 copy with -inf
    with_bans = lambda search: sample(logits, unbiased, [make_generator(p.seed, DEVICE) for p in unbiased], banned=banned,
                                      search_filter=search).token_ids
    assert torch.equal(with_bans(counted), with_bans(None)) and calls[-1] == torch.float32 and len(calls) == 4
    plain = [dataclasses.replace(p, top_k=0, top_p=1.0, min_p=0.0) for p in unbiased]
    assert torch.equal(draw(counted, plain), draw(None, plain)) and len(calls) == 4


def penalty_rows(B, V, Lp, Lo, seed):
    "Logits with ties, zeros and -inf, histories full of repeats with ragged -1 padding, and per-row penalties of every sign."
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=g) * 4).round(decimals=1)  # many zeros, of both signs
    if V > 10: logits[:, :10] = float("-inf")  # banned tokens that a history holds too
    prompt, output = torch.randint(0, min(V, 300), (B, Lp), generator=g), torch.randint(0, min(V, 300), (B, Lo), generator=g)
    for h in (prompt, output):
        for b in range(B): h[b, torch.randint(0, h.shape[1] + 1, (1,), generator=g).item():] = -1
    presence, frequency = torch.rand(B, generator=g) * 4 - 2, torch.rand(B, generator=g) * 4 - 2
    repetition = torch.rand(B, generator=g) * 2 + 0.1
    if B: presence[0], frequency[0], repetition[0] = 0.0, 0.0, 1.0  # a row without penalties in a penalised batch
    return logits, TokenHistory(prompt, output), presence, frequency, repetition


def fused_counts_are_zero(device) -> bool:
    return all(not c.any() for c in fused_ops._PENALTY_COUNTS.values())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN where NaN (a GPU writes its own NaN's bits), but for the sign of zero (apply_penalties can
    turn an untouched -0.0 into +0.0)."""
    a, b = a.cpu() + 0.0, b.cpu() + 0.0
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0).view(torch.int32), b.masked_fill(nan, 0).view(torch.int32))


@pytest.mark.parametrize("B, V, Lp, Lo, seed", [(6, 3000, 50, 80, 0), (3, 300, 2000, 1500, 1), (1, 128, 0, 5, 2), (4, 50, 7, 0, 3),
                                                (0, 100, 3, 3, 4), (9, 2048, 1025, 3, 5)])
def test_fused_penalties_equal_apply_penalties_bit_for_bit(B, V, Lp, Lo, seed):
    logits, history, *rows = penalty_rows(B, V, Lp, Lo, seed)
    if V > 12: logits[:, 10:12] = float("nan")  # NaN logits stay NaN
    want = apply_penalties(logits.clone(), history, *rows)
    got = apply_penalties_fused(logits.clone().to(DEVICE), TokenHistory(*(h.to(DEVICE) for h in history)), *(r.to(DEVICE) for r in rows))
    assert same_bits(got, want) and fused_counts_are_zero(DEVICE)  # every counter given back
    if B > 1: assert ((got.cpu() != logits) & ~logits.isnan()).any()  # row 0 has no penalties


def test_fused_penalties_reuse_their_counters_and_skip_ids_outside_the_vocabulary():
    logits, history, *rows = penalty_rows(5, 400, 30, 30, 7)
    dev = lambda *ts: [t.to(DEVICE) for t in ts]
    for B in (2, 5, 3):  # the table grows, then serves a smaller batch
        h = TokenHistory(*dev(history.prompt[:B], history.output[:B]))
        got = apply_penalties_fused(logits[:B].clone().to(DEVICE), h, *dev(*(r[:B] for r in rows)))
        assert torch.equal(got.cpu(), apply_penalties(logits[:B].clone(), TokenHistory(history.prompt[:B], history.output[:B]), *(r[:B] for r in rows)))
    wide = TokenHistory(*dev(torch.tensor([[5, 400, 10**6]]), torch.tensor([[399, 401, -1]])))
    got = apply_penalties_fused(logits[:1].clone().to(DEVICE), wide, *dev(*(r[1:2] for r in rows))).cpu()
    inside = TokenHistory(torch.tensor([[5, -1, -1]]), torch.tensor([[399, -1, -1]]))
    assert torch.equal(got, apply_penalties(logits[:1].clone(), inside, *(r[1:2] for r in rows))) and fused_counts_are_zero(DEVICE)
    strided = TokenHistory(*dev(history.prompt[:, ::2], history.output[:, ::3]))  # columns of a wider table
    got = apply_penalties_fused(logits.clone().to(DEVICE), strided, *dev(*rows))
    assert torch.equal(got.cpu(), apply_penalties(logits.clone(), TokenHistory(history.prompt[:, ::2], history.output[:, ::3]), *rows))


def test_fused_penalties_refuse_bad_arguments():
    logits, history, *rows = penalty_rows(3, 100, 4, 4, 8)
    logits, history, rows = logits.to(DEVICE), TokenHistory(*(h.to(DEVICE) for h in history)), [r.to(DEVICE) for r in rows]
    with pytest.raises(ValueError, match="float32"): apply_penalties_fused(logits.half(), history, *rows)
    with pytest.raises(ValueError, match="contiguous rows"): apply_penalties_fused(logits.T.contiguous().T, history, *rows)
    with pytest.raises(ValueError, match="B=2"): apply_penalties_fused(logits[:2], history, *(r[:2] for r in rows))
    with pytest.raises(ValueError, match=r"\(3,\) each"): apply_penalties_fused(logits, history, rows[0][:2], *rows[1:])
    packed = torch.stack(rows, 1)  # (3, 3): each parameter a strided column, as SamplingTensors holds them
    assert torch.equal(apply_penalties_fused(logits.clone(), history, *packed.unbind(1)), apply_penalties_fused(logits.clone(), history, *rows))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16 if DEVICE == "cpu" else torch.bfloat16])
def test_sample_with_fused_penalties_draws_what_apply_penalties_draws(dtype):
    "Same tokens and the same log probabilities: the fused kernels edit a copy, never the raw logits that logprobs read."
    logits, history, presence, frequency, repetition = penalty_rows(8, 3000, 40, 60, 9)
    logits, history = logits.to(dtype).to(DEVICE), TokenHistory(*(h.to(DEVICE) for h in history))
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.9, top_p=0.9, seed=i, presence_penalty=float(presence[i]),
                             frequency_penalty=float(frequency[i]), repetition_penalty=float(repetition[i]), logprobs=3) for i in range(8)]
    draw = lambda penalize: sample(logits, params, [make_generator(p.seed, DEVICE) for p in params], history, penalize=penalize)
    dense, fused = draw(None), draw(apply_penalties_fused)
    assert torch.equal(dense.token_ids, fused.token_ids) and torch.equal(dense.logprobs, fused.logprobs)
    assert torch.equal(dense.top_token_ids, fused.top_token_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("op", ["silu_and_mul", "rms_norm", "add_rms_norm", "rope"])
def test_gpu_row_kernels_past_two_to_the_31_elements(op):
    """A step of 131,072 tokens (Llama-3.1-8B's budget without chunked prefill) has 3.8e9 gate/up activations: offsets past 2**31 must not
    wrap. The last rows of a tensor that large equal the same op on those rows alone (bf16, up to 4.3 GB an input)."""
    big = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    last = lambda t: t[-2:].clone()
    if op == "silu_and_mul":
        x = big(75_000, 2 * 14_336)
        got, want = (silu_and_mul(x)[-2:],), (silu_and_mul(last(x)),)
    elif op in ("rms_norm", "add_rms_norm"):
        x, weight = big(2**19 + 7, 4096), big(4096)
        if op == "rms_norm": got, want = (rms_norm(x, weight, 1e-5)[-2:],), (rms_norm(last(x), weight, 1e-5),)
        else:
            h = big(*x.shape)
            got, want = tuple(t[-2:] for t in add_rms_norm(x, h, weight, 1e-5)), add_rms_norm(last(x), last(h), weight, 1e-5)
    else:
        x = big(2**19 + 7, 32, 128)
        cos, sin = torch.rand(len(x), 128, device="cuda"), torch.rand(len(x), 128, device="cuda")
        got, want = (rope(x, cos, sin)[-2:],), (rope(last(x), last(cos), last(sin)),)
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_search_filter_over_a_llama_3_vocabulary():
    logits, temperature, top_k, top_p, min_p = filter_rows(64, 128256, 7, torch.bfloat16)
    noise = torch.randn(64, 128256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(8))
    logits = logits + noise.to(torch.bfloat16)  # fewer ties than the rounding leaves
    for x in (logits, logits.float()):
        found = search_filter(x, temperature, top_k, top_p, min_p)
        assert torch.equal(found, filter_logits(x.float() / temperature[:, None], top_k, top_p, min_p))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("sms_per_program", [1, 2, 10**9])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_gpu_search_filter_with_rows_shared_out_among_programs(monkeypatch, B, sms_per_program):
    "Few rows: each row's blocks are shared among up to 16 programs that wait for each other; the same kept sets as one."
    monkeypatch.setattr(fused_ops, "SEARCH_SMS_PER_PROGRAM", sms_per_program)
    programs = fused_ops.search_programs(B, 128256, torch.device("cuda"))
    assert programs == (1 if sms_per_program == 10**9 else min(16, torch.cuda.get_device_properties(0).multi_processor_count // (sms_per_program * B)))
    logits, temperature, top_k, top_p, min_p = filter_rows(B, 128256, 10 + B, torch.bfloat16)
    logits = logits + torch.randn(logits.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(B)).to(torch.bfloat16)
    for x in (logits, logits.float()):
        assert torch.equal(search_filter(x, temperature, top_k, top_p, min_p), filter_logits(x.float() / temperature[:, None], top_k, top_p, min_p))
        for each in ((top_k, torch.ones_like(top_p)), (torch.full_like(top_k, 128256), top_p)):  # one search, then the other
            assert torch.equal(search_filter(x, temperature, *each, 0 * min_p), filter_logits(x.float() / temperature[:, None], *each, 0 * min_p))


def test_search_filter_runs_one_program_a_row_off_the_gpu():
    "The interpreter runs a grid's programs one after another, so programs that wait for each other would wait forever."
    assert fused_ops.search_programs(1, 128256, torch.device("cpu")) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_samples_with_the_search_filter_as_with_the_sort(monkeypatch):
    from nanoserve import LLM
    from nanoserve.model_runner import ModelRunner
    llm = LLM(tiny_model_dir("llama"), dtype="bfloat16", num_kv_blocks=256, max_model_len=256)
    params = [SamplingParams(temperature=0.9, top_k=(0, 20)[i % 2], top_p=0.8, max_tokens=16, ignore_eos=True, seed=i) for i in range(6)]
    prompts = [[1, 2, 3], list(range(10, 60)), [7] * 9] * 2
    assert llm.llm_engine.runner.search_filter is search_filter
    searched = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(ModelRunner, "search_filter", None)
    assert searched == [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_a_wrong_rotation_is_caught():
    x = torch.randn(3, 2, 16, device=DEVICE)
    cos, sin = angles(3, 16)
    assert not torch.allclose(rope(x, cos, -sin), apply_rope(x, cos, sin), atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
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


def test_merged_biases_are_views_and_the_merged_matmul_adds_them_once():
    parts = [torch.nn.Linear(8, n).to(DEVICE) for n in (4, 2, 2)]
    x = torch.randn(3, 8, device=DEVICE)
    with torch.inference_mode():
        want = torch.cat([p(x) for p in parts], -1)
        weight, bias = merge_linears(*parts), merge_biases(*parts)
        assert all(p.bias.untyped_storage().data_ptr() == bias.untyped_storage().data_ptr() for p in parts)
        torch.testing.assert_close(linear(x, weight, bias), want)
        torch.testing.assert_close(linear(x[:1], weight, bias), want[:1])  # one row: the GEMV, then the bias
    assert merge_biases(torch.nn.Linear(8, 4, bias=False)) is None


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
    with pytest.raises(ValueError, match="all have a bias, or none"): merge_biases(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False))
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
