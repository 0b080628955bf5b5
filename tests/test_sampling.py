import dataclasses, math, reprlib

import pytest, torch
from hypothesis import given, settings, strategies as st

from nanoserve.loader import load_model
from nanoserve.sampling import (MAX_LOGPROBS, argmax_rows, SamplingParams, SamplingTensors, StopCheck, check_stop, exponential_race,
                                filter_logits, find_stop, greedy_naive, make_generator, sample)
from nanoserve.testing import hf_default_model, hf_default_model_dir, hf_model, tiny_model_dir


# ---------------------------------------------------------------- an independent reference

def reference_kept(logits, p: SamplingParams, slack: float = 0.0) -> set:
    """The tokens `p` lets through, the slow obvious way in float64.
    slack > 0 widens the set (top-p and min-p thresholds), slack < 0 narrows it."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    if p.greedy: return {order[0]}
    w = [math.exp((l - logits[order[0]]) / p.temperature) for l in logits]
    kept = order[:p.top_k] if p.top_k > 0 else order
    total, mass, nucleus = sum(w[i] for i in kept), 0.0, []
    for i in kept:
        if p.top_p < 1 and mass >= p.top_p + slack: break
        nucleus.append(i); mass += w[i] / total
    return {i for i in nucleus if i == order[0] or w[i] >= p.min_p * w[order[0]] * (1 - slack)}


def reference_distribution(logits, p: SamplingParams) -> list:
    "The distribution `p` should sample from: temperature, then renormalised over the kept tokens."
    kept, top = reference_kept(logits, p), max(logits)
    w = [math.exp((l - top) / (p.temperature or 1)) if i in kept else 0.0 for i, l in enumerate(logits)]
    return [x / sum(w) for x in w]


def chi_square_p_value(counts: torch.Tensor, expected) -> float:
    "Pearson's chi-square p-value of `counts` against the probabilities `expected` (tokens with 0 must not occur)."
    expected = torch.tensor(expected, dtype=torch.float64)
    allowed = expected > 0
    assert counts[~allowed].sum() == 0, f"drew a token of probability 0: {counts.tolist()}"
    n, q = counts.sum(), expected[allowed]
    stat = ((counts[allowed] - n * q) ** 2 / (n * q)).sum()
    dof = torch.tensor(allowed.sum().item() - 1.0, dtype=torch.float64)
    return torch.special.gammaincc(dof / 2, stat / 2).item()


def draw_counts(logits: torch.Tensor, params: SamplingParams, n: int = 20_000, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    tokens = sample(logits.expand(n, -1), [params] * n).token_ids
    return torch.bincount(tokens, minlength=logits.shape[-1]).double()


Q = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])


# ---------------------------------------------------------------- distributions (chi-square)

def test_chi_square_p_value_matches_table():
    # chi-square critical values at 0.001 for 1 and 5 degrees of freedom: 10.828, 20.515
    for dof, critical in ((1, 10.828), (5, 20.515)):
        p = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(critical / 2, dtype=torch.float64))
        assert abs(p.item() - 1e-3) < 1e-5


def test_reference_matches_the_hand_computed_cases():
    logits = Q.log().tolist()
    assert [round(x, 6) for x in reference_distribution(logits, SamplingParams(top_k=2))] == [round(0.35 / 0.6, 6), round(0.25 / 0.6, 6), 0, 0, 0, 0]
    assert sum(x > 0 for x in reference_distribution(logits, SamplingParams(top_p=0.8))) == 4   # 0.35+0.25+0.15 < 0.8
    assert sum(x > 0 for x in reference_distribution(logits, SamplingParams(min_p=0.4))) == 3   # q >= 0.14


@pytest.mark.parametrize("params", [
    SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.6), SamplingParams(top_k=2),
    SamplingParams(top_p=0.8), SamplingParams(min_p=0.4), SamplingParams(temperature=1.3, top_k=5, top_p=0.85, min_p=0.2),
], ids=["plain", "T0.7", "T1.6", "topk2", "topp0.8", "minp0.4", "all"])
def test_sampled_distribution_matches_the_intended_one(params):
    counts = draw_counts(Q.log(), params)
    assert chi_square_p_value(counts, reference_distribution(Q.log().tolist(), params)) > 1e-3


def test_trap_chi_square_rejects_the_wrong_distribution():
    counts = draw_counts(Q.log(), SamplingParams(temperature=0.7))
    assert chi_square_p_value(counts, Q.tolist()) < 1e-6          # T=0.7 is not the model's distribution
    counts = draw_counts(Q.log(), SamplingParams(top_p=0.8))
    with pytest.raises(AssertionError, match="probability 0"):     # the nucleus has 4 tokens, not 3
        chi_square_p_value(counts, reference_distribution(Q.log().tolist(), SamplingParams(top_p=0.7)))


def test_exponential_race_samples_probs():
    torch.manual_seed(1)
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    counts = torch.bincount(exponential_race(probs.expand(20_000, -1)), minlength=4).double()
    assert chi_square_p_value(counts, probs.tolist()) > 1e-3


# ---------------------------------------------------------------- filters: never outside the allowed set

row_params = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(0.1, 3.0)),
    top_k=st.one_of(st.sampled_from([-1, 0, 1]), st.integers(1, 60)),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.01, 1.0)),
)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.5, 2.0, 8.0]), vocab=st.integers(2, 50),
       params=st.lists(row_params, min_size=1, max_size=4))
def test_filters_keep_exactly_the_reference_set_and_sampling_stays_inside(seed, scale, vocab, params):
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(seed)) * scale  # (B, V)
    t = SamplingTensors.from_params(params, vocab, "cpu")
    kept = torch.isfinite(filter_logits(logits / t.temperature[:, None], t.top_k, t.top_p, t.min_p))
    repeats = 100
    tokens = sample(logits.repeat(repeats, 1), params * repeats).token_ids.view(repeats, len(params))
    for row, p in enumerate(params):
        inner = torch.zeros(vocab, dtype=torch.bool); inner[list(reference_kept(logits[row].tolist(), p, slack=-1e-4))] = True
        outer = torch.zeros(vocab, dtype=torch.bool); outer[list(reference_kept(logits[row].tolist(), p, slack=1e-4))] = True
        if not p.greedy:
            assert (kept[row] >= inner).all() and (kept[row] <= outer).all(), (row, p)
        assert outer[tokens[:, row]].all(), (row, p, tokens[:, row])


def test_filters_match_transformers_warpers():
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(0)) * 3
    for t, k, p, m in [(1.0, 10, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.1), (0.7, 50, 0.9, 0.05), (1.5, 200, 0.95, 0.02)]:
        warpers = [TemperatureLogitsWarper(t)] + ([TopKLogitsWarper(k)] if k else []) + \
                  ([TopPLogitsWarper(p)] if p < 1 else []) + ([MinPLogitsWarper(m)] if m else [])
        ref = logits.clone()
        for w in warpers: ref = w(None, ref)
        st_ = SamplingTensors.from_params([SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)] * 8, 300, "cpu")
        ours = filter_logits(logits / st_.temperature[:, None], st_.top_k, st_.top_p, st_.min_p)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))
        torch.testing.assert_close(ours.softmax(-1), ref.softmax(-1))


def test_filters_always_keep_the_best_token():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(2))
    out = filter_logits(logits, torch.ones(5, dtype=torch.long), torch.full((5,), 1e-6), torch.ones(5))
    assert torch.equal(torch.isfinite(out).sum(-1), torch.ones(5, dtype=torch.long))
    assert torch.equal(out.argmax(-1), logits.argmax(-1))
    for top_p in (1e-46, 0.0):  # below float32's smallest number the tensor holds 0: the best token must still stay
        t = SamplingTensors.from_params([SamplingParams(top_p=1e-46)] * 5, 100, "cpu")
        out = filter_logits(logits, t.top_k, torch.full((5,), top_p), t.min_p)
        assert torch.equal(torch.isfinite(out).sum(-1), torch.ones(5, dtype=torch.long))
    assert sample(logits, [SamplingParams(top_p=1e-46, seed=0)] * 5).token_ids.tolist() == logits.argmax(-1).tolist()


def test_top_k_larger_than_vocab_and_disabled_values():
    logits = torch.randn(3, 10)
    for p in (SamplingParams(top_k=0), SamplingParams(top_k=-1), SamplingParams(top_k=1000)):
        t = SamplingTensors.from_params([p], 10, "cpu")
        assert t.top_k.item() == 10
        assert torch.isfinite(filter_logits(logits[:1], t.top_k, t.top_p, t.min_p)).all()


def test_filters_keep_ties_together():
    tied = torch.tensor([[3.0, 2.0, 1.0, 1.0, 1.0, 0.0]])  # three tokens tie for third place: top-k=3 keeps all of them
    assert torch.isfinite(filter_logits(tied, torch.tensor([3]), torch.ones(1), torch.zeros(1))).sum().item() == 5
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.2]])  # ahead of each 0.2 lies only the 0.4 (< 0.5): the nucleus keeps all three
    assert torch.isfinite(filter_logits(probs.log(), torch.tensor([4]), torch.tensor([0.5]), torch.zeros(1))).all()
    assert torch.isfinite(filter_logits(probs.log(), torch.tensor([4]), torch.tensor([0.3]), torch.zeros(1))).sum().item() == 1


def test_top_k_equals_transformers_with_ties():
    from transformers.generation.logits_process import TopKLogitsWarper
    logits = (torch.randn(16, 500, generator=torch.Generator().manual_seed(3)) * 2).bfloat16().float()  # many ties
    for k in (1, 5, 50, 499):
        ref = TopKLogitsWarper(k)(None, logits.clone())
        ours = filter_logits(logits, torch.full((16,), k), torch.ones(16), torch.zeros(16))
        assert torch.equal(torch.isfinite(ours), torch.isfinite(ref)), k


def _rows_with_ties(B=64, V=3000, seed=1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * torch.rand(B, 1, generator=g) * 6
    logits[::2] = logits[::2].bfloat16().float()  # ties
    logits[5, :500] = -math.inf  # banned tokens
    logits[7] = 0.0  # one big tie
    top_k = torch.randint(1, 60, (B,), generator=g)
    top_p = torch.rand(B, generator=g); top_p[::4] = 1.0; top_p[1] = 0.0
    min_p = torch.rand(B, generator=g) * 0.2; min_p[::2] = 0
    return logits, top_k, top_p, min_p


def _select_and_sort(monkeypatch, run):
    "run() with the filter selecting (torch.topk) wherever a bound allows it, then with it always sorting."
    import nanoserve.sampling as sampling
    calls, topk = [], torch.Tensor.topk
    def counted_topk(self, *args, **kwargs):
        calls.append(args); return topk(self, *args, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(sampling, "SELECT_FROM_ROWS", 1)
        m.setattr(torch.Tensor, "topk", counted_topk)
        selected = run()
        assert calls, "the filter did not select"
        m.setattr(sampling, "SELECT_FROM_ROWS", 10**9)
        calls.clear()
        by_sort = run()
        assert not calls, "the filter selected"
    return selected, by_sort


def test_selecting_top_k_equals_sorting(monkeypatch):
    logits, top_k, top_p, min_p = _rows_with_ties()
    for bound in (59, 64, 1024):
        selected, by_sort = _select_and_sort(monkeypatch, lambda: filter_logits(logits, top_k, top_p, min_p, max_top_k=bound))
        assert torch.equal(selected, by_sort)  # the same K values, then the same arithmetic: bit for bit
        assert torch.equal(selected, filter_logits(logits, top_k, top_p, min_p))  # no bound: sums in another order, same tokens here
    ties = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 3.0, 1.0]]).repeat(32, 1)  # the k-th value ties past the k values topk returns
    args = torch.full((32,), 3), torch.full((32,), 0.8), torch.zeros(32)  # the four 3s hold 28 % of the mass: all stay
    selected, by_sort = _select_and_sort(monkeypatch, lambda: filter_logits(ties, *args, max_top_k=3))
    assert torch.equal(selected, by_sort) and torch.isfinite(selected).sum(-1).tolist() == [6] * 32
    # a cut within a rounding error of top-p (found in review): the two paths must still agree
    row = ((torch.randn(32, 5000, generator=torch.Generator().manual_seed(0)) * 0.3) * 8).round()[0] / 8  # many ties
    args = torch.full((32,), 50), torch.full((32,), 0.023509737104177475), torch.zeros(32)
    selected, by_sort = _select_and_sort(monkeypatch, lambda: filter_logits(row.repeat(32, 1), *args, max_top_k=50))
    assert torch.equal(selected, by_sort)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_selecting_top_k_equals_sorting_on_the_gpu(monkeypatch):
    logits, top_k, top_p, min_p = (t.cuda() for t in _rows_with_ties(B=256, V=32000))
    for bound in (59, 1024):
        selected, by_sort = _select_and_sort(monkeypatch, lambda: filter_logits(logits, top_k, top_p, min_p, max_top_k=bound))
        assert torch.equal(selected, by_sort)


def test_sample_with_a_small_top_k_draws_what_the_sort_path_draws(monkeypatch):
    logits = (torch.randn(32, 2000, generator=torch.Generator().manual_seed(4)) * 3).bfloat16().float()  # with ties
    params = [SamplingParams(top_k=k, top_p=p, min_p=m, seed=s) for s, (k, p, m) in
              enumerate([(5, 1.0, 0), (50, 0.9, 0), (1, 1.0, 0), (20, 0.5, 0.1), (50, 0.95, 0), (2, 1.0, 0), (3, 0.6, 0), (40, 1.0, 0.2)] * 4)]
    selected, by_sort = _select_and_sort(monkeypatch, lambda: sample(logits, params, [make_generator(p.seed) for p in params]).token_ids)
    assert torch.equal(selected, by_sort)


def test_sorting_bfloat16_logits_draws_what_sorting_their_float32_copy_draws():
    logits = (torch.randn(6, 3000, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()  # ties too
    params = [SamplingParams(temperature=t, top_p=p, min_p=m, seed=s)
              for s, (t, p, m) in enumerate([(0.7, 0.9, 0), (1.3, 0.5, 0), (1.0, 0.95, 0.05), (0.5, 0.3, 0), (2.0, 0.99, 0), (0.9, 0.8, 0.2)])]
    bf16_full, fp32_full = (sample(x, params, [make_generator(p.seed) for p in params]).token_ids for x in (logits, logits.float()))
    assert torch.equal(bf16_full, fp32_full)
    for p, k in zip(params, (30, 7, 100, 1, 64, 12)): p.top_k = k  # every row bounded: the presorted rows are cut to K = 100
    bf16 = sample(logits, params, [make_generator(p.seed) for p in params]).token_ids  # sorts the bfloat16 rows
    fp32 = sample(logits.float(), params, [make_generator(p.seed) for p in params]).token_ids  # sorts the scaled float32 rows
    assert torch.equal(bf16, fp32)
    t = SamplingTensors.from_params(params, 3000, "cpu")
    scaled = logits.float() / t.temperature[:, None]
    presorted = logits.sort(dim=-1, descending=True).values.float() / t.temperature[:, None]
    assert torch.equal(filter_logits(scaled, t.top_k, t.top_p, t.min_p, sorted_logits=presorted),
                       filter_logits(scaled, t.top_k, t.top_p, t.min_p))


# ---------------------------------------------------------------- greedy rows, seeds, logprobs

@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.sampled_from([7, 4096, 49152, 128256, 151936]), st.integers(0, 2**31 - 1),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_argmax_rows_equals_argmax_ties_included(B, V, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (B, V), generator=g).to(dtype)  # few distinct values: many ties, across chunks too
    x[0, torch.randint(0, V, (3,), generator=g)] = 9  # the maximum three times in one row
    x = x.to("cuda" if torch.cuda.is_available() else "cpu")  # on a GPU, CUDA's reduction breaks ties as well
    assert torch.equal(argmax_rows(x), x.argmax(-1))


def test_greedy_rows_equal_argmax_in_a_mixed_batch():
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(0)) * 2
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5), SamplingParams(temperature=1e-6, top_k=3),
              SamplingParams(temperature=0, top_p=0.1, min_p=0.9), SamplingParams(top_p=0.5), SamplingParams(temperature=0.0)]
    greedy = torch.tensor([p.greedy for p in params])
    for seed in range(5):
        torch.manual_seed(seed)
        out = sample(logits, params).token_ids
        assert torch.equal(out[greedy], logits.argmax(-1)[greedy])


def test_all_greedy_batch_is_argmax_and_consumes_no_randomness():
    logits = torch.randn(4, 50)
    torch.manual_seed(0); before = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(sample(logits, [SamplingParams(temperature=0)] * 4).token_ids, logits.argmax(-1))
    assert torch.equal(torch.rand(1), before)


def row_tokens(logits, batch_size: int, row: int, seed, steps: int = 20) -> list:
    params = [SamplingParams(temperature=1.0)] * batch_size
    params[row] = SamplingParams(temperature=1.2, top_p=0.95, seed=seed)
    gens = [make_generator(p.seed) for p in params]
    return [sample(logits.expand(batch_size, -1), params, gens).token_ids[row].item() for _ in range(steps)]


def test_seeded_row_is_reproducible_whatever_its_batch():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    alone = row_tokens(logits, 1, 0, seed=7)
    torch.manual_seed(123)  # the global generator's state must not matter
    assert row_tokens(logits, 5, 3, seed=7) == alone
    assert row_tokens(logits, 9, 0, seed=7) == alone
    assert len(set(alone)) > 1  # it does sample, it is not greedy


def test_trap_unseeded_rows_differ_and_seeds_differ():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert row_tokens(logits, 3, 1, seed=None) != row_tokens(logits, 3, 1, seed=None)
    assert row_tokens(logits, 3, 1, seed=7) != row_tokens(logits, 3, 1, seed=8)


def test_make_generator():
    assert make_generator(None) is None
    g = make_generator(5)
    assert isinstance(g, torch.Generator) and g.initial_seed() == 5 and g.device == torch.device("cpu")


def test_logprobs_equal_log_softmax_of_the_raw_logits():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(logprobs=3, temperature=0.5), SamplingParams(), SamplingParams(logprobs=0, top_k=5),
              SamplingParams(temperature=0, logprobs=MAX_LOGPROBS)]
    out = sample(logits, params, [None, None, make_generator(1), None])
    logp = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(out.logprobs.double(), logp.gather(-1, out.token_ids[:, None])[:, 0], atol=1e-5, rtol=0)
    assert out.top_logprobs.shape == out.top_token_ids.shape == (4, MAX_LOGPROBS)
    ref = logp.topk(MAX_LOGPROBS, dim=-1)
    assert torch.equal(out.top_token_ids, ref.indices)
    torch.testing.assert_close(out.top_logprobs.double(), ref.values, atol=1e-5, rtol=0)
    assert out.top_token_ids[3, 0] == out.token_ids[3]  # the greedy row chose the most likely token


def test_no_logprobs_unless_asked():
    out = sample(torch.randn(2, 10), [SamplingParams(), SamplingParams(temperature=0)])
    assert out.logprobs is None and out.top_logprobs is None and out.top_token_ids is None
    assert out.token_ids.shape == (2,) and out.token_ids.dtype == torch.long


def test_sample_checks_one_params_per_row_and_accepts_half_precision():
    with pytest.raises(ValueError, match="2 SamplingParams for 3 rows"):
        sample(torch.randn(3, 10), [SamplingParams()] * 2)
    with pytest.raises(ValueError, match=r"logits must be \(B, V\), one row per sequence; got shape \(10,\)"):
        sample(torch.randn(10), [SamplingParams()] * 10)  # a lone row of 10 logits is not 10 rows
    with pytest.raises(ValueError, match="got 3 generators for 2 rows"):
        sample(torch.randn(2, 10), [SamplingParams()] * 2, [None] * 3)
    logits = torch.randn(2, 10).bfloat16()
    assert torch.equal(sample(logits, [SamplingParams(temperature=0)] * 2).token_ids, logits.float().argmax(-1))


def test_masked_tokens_are_never_drawn():
    logits = torch.full((1000, 8), -math.inf)
    logits[:, [2, 5]] = torch.tensor([0.0, 1.0])
    tokens = sample(logits, [SamplingParams(temperature=2.0, top_p=0.99)] * 1000).token_ids
    assert set(tokens.tolist()) == {2, 5}


# ---------------------------------------------------------------- SamplingParams validation

@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "1"),
    ("temperature", 1e39),  # finite, but inf in float32, where every logit over it is 0: top_k=1 would not be the argmax
    ("temperature", True), ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", None), ("top_k", -2),
    ("top_k", 2.5), ("top_k", "5"), ("min_p", -0.01), ("min_p", 1.5), ("seed", 1.5), ("seed", "42"),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 10.0), ("max_tokens", None), ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 2.0), ("logprobs", True), ("ignore_eos", 1), ("ignore_eos", "yes"),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", 5), ("stop", [1, 2]), ("stop", {"a"}), ("stop_token_ids", 2),
    ("stop_token_ids", [1, -1]), ("stop_token_ids", ["a"]), ("presence_penalty", 2.5), ("frequency_penalty", -2.01),
    ("frequency_penalty", float("nan")), ("repetition_penalty", 0.0), ("repetition_penalty", 101.0), ("repetition_penalty", True),
    ("logit_bias", {5: 100.5}), ("logit_bias", {-1: 1.0}), ("logit_bias", {1.5: 1.0}), ("logit_bias", {5: float("inf")}),
    ("logit_bias", [5, 1.0]), ("logit_bias", "5"), ("logit_bias", {i: 1.0 for i in range(301)}),
])
def test_invalid_field_raises_value_error_naming_field_and_value(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    message = str(e.value)
    assert message.startswith(f"{field}={reprlib.repr(value)}: expected "), message  # long values shortened


def test_valid_params_are_normalised():
    p = SamplingParams(temperature=0, top_p=1, min_p=0, stop="###", stop_token_ids=[7, 8], seed=-3, logprobs=0)
    assert p.temperature == 0.0 and isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert p.stop == ("###",) and p.stop_token_ids == (7, 8) and p.greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b") and SamplingParams().stop == ()
    assert SamplingParams(stop_token_ids={3}).stop_token_ids == (3,)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    assert not SamplingParams(temperature=1e-5).greedy and SamplingParams(temperature=9e-6).greedy
    d = SamplingParams()
    assert (d.temperature, d.top_p, d.top_k, d.min_p, d.seed, d.max_tokens, d.stop, d.stop_token_ids, d.ignore_eos,
            d.logprobs) == (1.0, 1.0, 0, 0.0, None, 16, (), (), False, None)


def test_params_are_slotted_and_replace_revalidates():
    p = SamplingParams()
    with pytest.raises(AttributeError): p.temprature = 0.5  # a typo is an error, not a new attribute
    assert dataclasses.replace(p, max_tokens=100).max_tokens == 100
    with pytest.raises(ValueError, match="max_tokens=0"): dataclasses.replace(p, max_tokens=0)


def test_assignment_is_checked_as_construction_is():
    "A request holds its params while it runs: a later assignment must not slip a bad value past the constructor."
    p = SamplingParams(max_tokens=4)
    for field, value in [("max_tokens", 0), ("temperature", float("nan")), ("min_p", 2.0), ("seed", "x"), ("stop", [""]),
                         ("stop_token_ids", [-1]), ("logprobs", MAX_LOGPROBS + 1)]:
        with pytest.raises(ValueError, match=f"^{field}="): setattr(p, field, value)
    assert p == SamplingParams(max_tokens=4)  # every refused assignment left the value as it was
    p.stop, p.temperature = "##", 0
    assert p.stop == ("##",) and p.temperature == 0.0 and isinstance(p.temperature, float)


def test_numpy_numbers_become_python_numbers():
    import numpy as np
    p = SamplingParams(seed=np.int64(3), top_k=np.int32(5), max_tokens=np.int64(4), logprobs=np.int8(2),
                       temperature=np.float32(0.5), top_p=np.float64(0.9))
    assert [type(v) for v in (p.seed, p.top_k, p.max_tokens, p.logprobs)] == [int] * 4
    assert type(p.temperature) is float and type(p.top_p) is float
    assert torch.Generator().manual_seed(p.seed).initial_seed() == 3  # torch refuses numpy's integers here


def test_a_number_too_large_for_a_float_is_a_value_error():
    with pytest.raises(ValueError, match=r"^temperature=\d+\.\.\.\d+: expected"): SamplingParams(temperature=2**2000)


# ---------------------------------------------------------------- stop conditions

def feed(pieces, params, eos=(0,), token_ids=None):
    "Feed text pieces one token at a time; return (number of tokens fed, the final StopCheck)."
    text = ""
    for n, piece in enumerate(pieces, start=1):
        token = token_ids[n - 1] if token_ids else 100 + n
        prev, text = len(text), text + piece
        check = check_stop(token, text, n, params, eos, prev_text_len=prev)
        if check.finished: return n, check
    return len(pieces), check


def test_stop_string_split_across_tokens():
    n, check = feed(["Hel", "lo W", "orld", "!"], SamplingParams(stop=["o Wo"], max_tokens=10))
    assert (n, check) == (3, StopCheck(True, "stop", "Hell", "o Wo"))


def test_trap_searching_only_the_new_text_misses_a_split_stop_string():
    text, prev = "Hello World", len("Hello W")
    assert text.find("o Wo", prev) == -1  # the naive search: only the new piece "orld"
    assert find_stop(text, ["o Wo"], prev) == (4, "o Wo")
    assert check_stop(1, text, 3, SamplingParams(stop="o Wo"), (), prev_text_len=prev).text == "Hell"


def test_stop_string_spanning_three_tokens_and_inside_one_token():
    assert feed(["a", "b", "c", "d", "e"], SamplingParams(stop="bcd"))[1] == StopCheck(True, "stop", "a", "bcd")
    assert feed(["xx", "yEND", "zz"], SamplingParams(stop="END"))[1] == StopCheck(True, "stop", "xxy", "END")
    assert feed(["STOP here"], SamplingParams(stop="STOP"))[1] == StopCheck(True, "stop", "", "STOP")


def test_earliest_stop_string_wins():
    params = SamplingParams(stop=["world", "lo", "xyz"])
    assert feed(["hello world"], params)[1].text == "hel"
    assert find_stop("abcabc", ["c", "bc"]) == (1, "bc") and find_stop("abc", ["z"]) == find_stop("abc", []) == (-1, None)
    assert find_stop("abcabc", ["bc", "c"]) == (1, "bc") and find_stop("xabq", ["ab"], 3) == (-1, None)  # "ab" ended before


def test_a_stop_string_that_ended_while_min_tokens_held_stops_nothing_later():
    "Only a match that ends in the new text is new: one that ended inside min_tokens stays ignored, whatever the other stops."
    for stops in (["ab"], ["ab", "wxyz"]):
        for keep in (False, True):
            p = SamplingParams(stop=stops, min_tokens=2, max_tokens=5, include_stop_str_in_output=keep)
            assert feed(["xabq", "c", "d"], p) == (3, StopCheck(False, None, "xabqcd"))


def test_eos_stop_token_ids_and_ignore_eos():
    eos = {2, 9}
    assert check_stop(2, "hi", 1, SamplingParams(), eos, 2) == StopCheck(True, "stop", "hi")
    assert check_stop(9, "hi", 1, SamplingParams(), eos).reason == "stop"
    assert check_stop(2, "hi", 1, SamplingParams(), 2).reason == "stop"  # a single id works too
    assert check_stop(2, "hi", 1, SamplingParams(ignore_eos=True), eos) == StopCheck(False, None, "hi")
    assert check_stop(5, "hi", 1, SamplingParams(stop_token_ids=[5], ignore_eos=True), eos).reason == "stop"
    assert check_stop(5, "hi", 1, SamplingParams(), eos) == StopCheck(False, None, "hi")
    assert check_stop(5, "hi", 1, SamplingParams(stop_token_ids=[5]), eos, 2) == StopCheck(True, "stop", "hi", 5)  # vLLM's stop_reason
    assert check_stop(5, "hi!", 1, SamplingParams(stop_token_ids=[5]), eos, 2).text == "hi"  # the stop token's text is cut, as vLLM cuts it
    assert check_stop(5, "hi!", 1, SamplingParams(stop_token_ids=[5], include_stop_str_in_output=True), eos, 2).text == "hi!"
    assert check_stop(2, "hi</s>", 1, SamplingParams(include_stop_str_in_output=True), eos, 2).text == "hi</s>"
    assert check_stop(2, "hi", 1, SamplingParams(stop_token_ids=[2]), eos).stop_reason is None  # EOS first, as vLLM checks
    # where the token's text begins not given: nothing is cut for a stop token, and a stop string is found anywhere
    assert check_stop(5, "hi!", 1, SamplingParams(stop_token_ids=[5]), eos) == StopCheck(True, "stop", "hi!", 5)
    assert check_stop(2, "hi</s>", 1, SamplingParams(skip_special_tokens=False), eos).text == "hi</s>"
    assert check_stop(7, "ab.cd", 2, SamplingParams(stop="."), eos) == StopCheck(True, "stop", "ab", ".")
    assert feed(["hello world"], SamplingParams(stop=["world", "lo", "l"]))[1] == StopCheck(True, "stop", "he", "l")
    assert feed(["hello world"], SamplingParams(stop=["llo", "ll"]))[1] == StopCheck(True, "stop", "he", "llo")  # the first given
    kept = SamplingParams(stop=["o W", "xyz"], include_stop_str_in_output=True)
    assert feed(["Hel", "lo W", "orld"], kept) == (2, StopCheck(True, "stop", "Hello W", "o W"))  # vLLM's include_stop_str_in_output


def test_length_and_precedence():
    assert check_stop(5, "abc", 3, SamplingParams(max_tokens=3), ()) == StopCheck(True, "length", "abc")
    assert check_stop(5, "abc", 2, SamplingParams(max_tokens=3), ()).finished is False
    assert check_stop(2, "abc", 3, SamplingParams(max_tokens=3), (2,)).reason == "stop"    # EOS beats length
    assert check_stop(5, "ab.c", 3, SamplingParams(max_tokens=3, stop="."), (), 2) == StopCheck(True, "stop", "ab", ".")
    assert check_stop(2, "abc", 3, SamplingParams(max_tokens=3, ignore_eos=True), (2,)).reason == "length"


def test_stop_string_equal_to_the_whole_text_and_repeated_checks():
    params = SamplingParams(stop=["ab"])
    assert check_stop(1, "ab", 1, params, (), 0).text == ""
    assert check_stop(1, "xaab", 2, params, (), 3).text == "xa"   # begins 1 char before the new text


# ---------------------------------------------------------------- naive greedy against transformers

@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_naive_matches_transformers_on_tiny_models(arch):
    ours, hf = load_model(tiny_model_dir(arch)), hf_model(tiny_model_dir(arch))
    for length in (1, 7, 30):
        prompt = torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        mine = greedy_naive(ours, prompt, 20)
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, eos_token_id=None,
                                 pad_token_id=0)[0, length:].tolist()
        assert mine == theirs and len(mine) == 20
        stop = mine[4]  # a token the model produces becomes a stop token on both sides
        mine = greedy_naive(ours, prompt, 20, stop_token_ids=(stop,))
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, eos_token_id=stop,
                                 pad_token_id=0)[0, length:].tolist()
        assert mine == theirs and mine[-1] == stop and len(mine) <= 5


def test_trap_greedy_naive_differs_for_another_model():
    prompt = list(range(10, 20))
    assert greedy_naive(load_model(tiny_model_dir("llama")), prompt, 10) != greedy_naive(load_model(tiny_model_dir("qwen3")), prompt, 10)


def test_greedy_naive_matches_transformers_on_the_default_model():
    from transformers import AutoTokenizer
    ours, hf = load_model(), hf_default_model()
    tok = AutoTokenizer.from_pretrained(hf_default_model_dir())
    answers = []
    for question in ("What is the capital of France?", "Name three primary colors."):
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        mine = greedy_naive(ours, ids, 20, stop_token_ids=(ours.config.eos_token_id,))
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20)[0, len(ids):].tolist()
        assert mine == theirs
        answers.append(tok.decode(mine, skip_special_tokens=True))
    assert "Paris" in answers[0]


# ---------------------------------------------------------------- penalties and logit bias

from nanoserve.sampling import TokenHistory, apply_logit_bias, apply_penalties, sample, token_counts


def penalties_by_loop(logits, prompts, outputs, presence, frequency, repetition):
    "The penalties one row and one token at a time, as their definitions read."
    out = logits.clone()
    for b in range(len(logits)):
        for v in range(logits.shape[1]):
            c = outputs[b].count(v)
            if c or v in prompts[b]:
                out[b, v] = out[b, v] / repetition[b] if out[b, v] > 0 else out[b, v] * repetition[b]
            out[b, v] -= frequency[b] * c + presence[b] * (c > 0)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_penalties_equal_their_definition_one_token_at_a_time(seed):
    g = torch.Generator().manual_seed(seed)
    B, V = 5, 40
    logits = torch.randn(B, V, generator=g) * 3
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(0, 12, (B,), generator=g)]
    outputs = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(0, 20, (B,), generator=g)]
    presence, frequency = (torch.rand(B, generator=g) * 4 - 2 for _ in range(2))
    repetition = torch.rand(B, generator=g) * 2 + 0.5
    ours = apply_penalties(logits, TokenHistory.from_lists(prompts, outputs, "cpu"), presence, frequency, repetition)
    ref = penalties_by_loop(logits, prompts, outputs, presence.tolist(), frequency.tolist(), repetition.tolist())
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def test_repetition_penalty_equals_transformers_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    g = torch.Generator().manual_seed(0)
    logits, seen = torch.randn(3, 100, generator=g), torch.randint(0, 100, (3, 30), generator=g)
    for r in (0.7, 1.0, 1.5):
        ref = RepetitionPenaltyLogitsProcessor(r)(seen, logits.clone())
        history = TokenHistory.from_lists(seen[:, :10].tolist(), seen[:, 10:].tolist(), "cpu")  # prompt and output alike
        assert torch.equal(apply_penalties(logits, history, torch.zeros(3), torch.zeros(3), torch.full((3,), r)), ref)


def test_token_counts_skip_padding_and_empty_histories_are_fine():
    h = TokenHistory.from_lists([[], [1, 1]], [[2, 2, 2], []], "cpu")
    assert h.prompt.tolist() == [[-1, -1, -1], [1, 1, -1]] and h.output.tolist() == [[2, 2, 2], [-1, -1, -1]]  # one width: one copy
    assert token_counts(h.output, 4).tolist() == [[0, 0, 3, 0], [0, 0, 0, 0]]
    empty = TokenHistory.from_lists([], [], "cpu")
    assert empty.prompt.shape == (0, 0) and token_counts(empty.output, 4).shape == (0, 4)


def test_logit_bias_leaves_the_raw_logits_and_their_logprobs_alone():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    out = sample(logits, [SamplingParams(temperature=0, logit_bias={7: 100}, logprobs=2), SamplingParams(temperature=0, logprobs=2)])
    assert torch.equal(logits, before) and out.token_ids.tolist() == [7, logits[1].argmax().item()]
    assert torch.allclose(out.logprobs[0], logits[0].log_softmax(-1)[7])  # the raw distribution's, not the biased one's
    with pytest.raises(ValueError, match="outside the vocabulary of 30"):
        apply_logit_bias(logits.clone(), [SamplingParams(logit_bias={30: 1.0}), SamplingParams()])


def test_penalties_change_greedy_and_sampled_rows_and_need_a_history():
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    params = [SamplingParams(temperature=0, presence_penalty=0.5), SamplingParams(temperature=1e-4, frequency_penalty=0.5)]
    with pytest.raises(ValueError, match="penalties need the tokens each row has seen"): sample(logits, params)
    history = TokenHistory.from_lists([[2], [2]], [[0], [0]], "cpu")  # both have produced token 0 once
    assert sample(logits, params, history=history).token_ids.tolist() == [1, 1]
    assert sample(logits, [SamplingParams(temperature=0, repetition_penalty=2.0)] * 2, history=history).token_ids.tolist() == [1, 1]
    assert sample(logits, [SamplingParams(temperature=0)] * 2, history=history).token_ids.tolist() == [0, 0]


def test_penalty_params_are_normalised_and_pickle():
    import pickle
    p = SamplingParams(presence_penalty=1, logit_bias={9: -100, 3: 2}, repetition_penalty=2)
    assert p.logit_bias == ((3, 2.0), (9, -100.0)) and p.penalized and isinstance(p.presence_penalty, float)
    assert pickle.loads(pickle.dumps(p)) == p and dataclasses.replace(p, max_tokens=3).logit_bias == p.logit_bias
    assert not SamplingParams().penalized and not SamplingParams(logit_bias={1: 5}).penalized


# ---------------------------------------------------------------- min_tokens

from nanoserve.sampling import ban_tokens, stop_tokens


def test_min_tokens_holds_back_every_stop_and_bans_the_stop_tokens():
    p = SamplingParams(min_tokens=3, max_tokens=10, stop=["x"], stop_token_ids=[5])
    assert check_stop(2, "x", 2, p, eos_token_ids={2}) == StopCheck(False, None, "x")  # EOS and a stop string, too early
    assert check_stop(2, "x", 3, p, eos_token_ids={2}).reason == "stop"
    assert stop_tokens(p, (2,), 2) == (5, 2) and stop_tokens(p, (2,), 3) == ()
    assert stop_tokens(SamplingParams(min_tokens=3, ignore_eos=True), (2,), 0) == ()
    logits = torch.zeros(2, 8); logits[:, 2] = 10.0
    out = sample(logits, [SamplingParams(temperature=0, min_tokens=1, logprobs=1)] * 2, banned=[(2,), ()])
    assert out.token_ids.tolist()[1] == 2 and out.token_ids.tolist()[0] != 2  # only the first row is held back
    assert torch.allclose(out.logprobs[0], logits[0].log_softmax(-1)[out.token_ids[0]])  # the raw distribution's
    assert ban_tokens(torch.zeros(1, 4), [(1, 99)]).tolist() == [[0.0, float("-inf"), 0.0, 0.0]]  # ids past V skipped
    with pytest.raises(ValueError, match="min_tokens=11: expected at most max_tokens=10"): SamplingParams(min_tokens=11, max_tokens=10)
    with pytest.raises(ValueError, match="min_tokens=3: expected at most max_tokens=2"): dataclasses.replace(p, max_tokens=2)
    with pytest.raises(ValueError, match="max_tokens=2: expected at least min_tokens=3"): p.max_tokens = 2
