"""The diffusion-ELBO estimator against exact enumeration, and its invariances."""

import itertools
import math

import numpy as np
import pytest
import torch

from mdlmpe_ds.diffusion.elbo import diffusion_elbo, noise_level, sequence_losses

V, MASK = 3, 3  # tokens 0..2, mask id 3
EPS = 0.05


class ContextModel(torch.nn.Module):
    """Logits at i depend on the (masked) token at i and the mean of the other valid tokens."""

    def __init__(self, scale: float = 1.0):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.emb = torch.nn.Parameter(torch.randn(V + 1, 8, generator=g) * scale)
        self.ctx = torch.nn.Parameter(torch.randn(V + 1, 8, generator=g) * scale)
        self.out = torch.nn.Parameter(torch.randn(8, V, generator=g) * scale)

    def forward(self, ids, valid):
        w = valid.float()  # [B, L]
        ctx = (self.ctx[ids] * w[..., None]).sum(1, keepdim=True) / w.sum(1, keepdim=True)[
            ..., None
        ]  # [B,1,8]
        return torch.tanh(self.emb[ids] + ctx) @ self.out  # [B, L, V]


class ExactELBO:
    """The exact law of one sequence's ELBO term X by enumerating every mask subset.

    Given t, X = sum_{i in S} CE_i(S) / p with P(S) = p^|S| (1 - p)^(L - |S|), so g(t) = E[X | t] and
    g2(t) = E[X^2 | t] are polynomials in t of degree < 2L + 1: Gauss–Legendre with 40 nodes
    integrates them (and products of two g's) exactly over any interval.
    """

    def __init__(self, model, x):
        L = len(x)
        ids = torch.tensor([x])
        self.terms = []  # (|S|, sum of CE over S)
        for subset in itertools.product([0, 1], repeat=L):
            s = torch.tensor(subset, dtype=torch.bool)
            noisy = torch.where(s[None], torch.full_like(ids, MASK), ids)
            with torch.no_grad():
                logp = torch.log_softmax(model(noisy, torch.ones_like(ids, dtype=torch.bool)).double(), -1)[0]
            self.terms.append((int(s.sum()), float(-logp[torch.arange(L), ids[0]][s].sum())))
        self.L = L

    def g(self, t, power=1):
        p = noise_level(torch.as_tensor(t, dtype=torch.float64), EPS).numpy()
        return sum(p**k * (1 - p) ** (self.L - k) * (ce / p) ** power for k, ce in self.terms)

    @staticmethod
    def integrate(f, lo=0.0, hi=1.0):
        nodes, weights = np.polynomial.legendre.leggauss(40)
        t = lo + (nodes + 1) / 2 * (hi - lo)
        return float(np.sum(weights / 2 * (hi - lo) * f(t)))

    def mean(self):
        return self.integrate(self.g)

    def replicate_variance(self, t_sampling, group):
        """Variance of one replicate (the mean of a group of samples) under ``t_sampling``."""
        m = self.mean()
        var = self.integrate(lambda t: self.g(t, 2)) - m**2
        if t_sampling == "iid":
            return var
        if t_sampling == "antithetic":  # Cov(X(t), X(1 - t)) = Cov(g(t), g(1 - t)): masks independent
            cov = self.integrate(lambda t: self.g(t) * self.g(1 - t)) - m**2
            return (var + cov) / 2
        # stratified: t_i = t0 + i / G with t0 ~ U[0, 1/G) (no wrap-around), masks independent given t
        within = self.integrate(lambda t: self.g(t, 2) - self.g(t) ** 2)

        def h(t0):
            return sum(self.g(t0 + i / group) for i in range(group)) / group

        between = group * self.integrate(lambda t0: h(t0) ** 2, 0.0, 1.0 / group) - m**2
        return within / group + between


@pytest.mark.parametrize("t_sampling", ["iid", "antithetic", "stratified"])
def test_monte_carlo_matches_exact_enumeration(t_sampling):
    model = ContextModel()
    seqs = [[0, 2, 1, 1], [2, 2, 0, 1]]
    exact = [ExactELBO(model, x) for x in seqs]
    K, G = 2000, 4
    res = diffusion_elbo(
        model,
        [{"input_ids": torch.tensor(seqs)}],
        MASK,
        K,
        seed=3,
        eps=EPS,
        t_sampling=t_sampling,
        group_size=G,
    )
    T = sum(len(x) for x in seqs)
    truth = sum(e.mean() for e in exact) / T
    assert res.num_tokens == T and res.num_sequences == 2 and res.num_samples == K
    assert abs(res.nll_per_token - truth) < 3.5 * res.stderr, (res, truth)
    # The reported standard error agrees with the exact Monte-Carlo variance of the scheme.
    group = {"iid": 1, "antithetic": 2, "stratified": G}[t_sampling]
    exact_se = math.sqrt(sum(e.replicate_variance(t_sampling, group) for e in exact) / (K // group)) / T
    assert res.stderr == pytest.approx(exact_se, rel=0.15)
    # Non-trivial: the bound differs from the model's fully-masked guess.
    assert abs(truth - math.log(V)) > 0.05


def test_untrained_model_perplexity_is_near_vocab_size():
    vocab, L = 50, 64
    torch.manual_seed(0)
    emb = torch.nn.Embedding(vocab + 1, 16)
    head = torch.nn.Linear(16, vocab)
    torch.nn.init.normal_(emb.weight, std=0.02)
    torch.nn.init.normal_(head.weight, std=0.02)

    def model_fn(ids, valid):
        return head(emb(ids))

    data = torch.randint(0, vocab, (32, L))
    res = diffusion_elbo(model_fn, [{"input_ids": data}], vocab, 64, seed=0)
    assert abs(res.nll_per_token - math.log(vocab)) < 3 * res.stderr
    lo, hi = res.perplexity_interval
    assert 0.8 * vocab < lo < vocab < hi < 1.25 * vocab


def test_estimate_does_not_depend_on_batch_size_or_padding():
    model = ContextModel()
    g = torch.Generator().manual_seed(5)
    lengths = [5, 3, 6, 4]
    seqs = [torch.randint(0, V, (n,), generator=g) for n in lengths]
    kw = dict(mask_id=MASK, num_samples=8, seed=11, eps=EPS)

    def padded(batch_ids, width):
        ids = torch.zeros(len(batch_ids), width, dtype=torch.long)
        valid = torch.zeros(len(batch_ids), width, dtype=torch.bool)
        for r, i in enumerate(batch_ids):
            ids[r, : lengths[i]] = seqs[i]
            ids[r, lengths[i] :] = 2  # padding content must not matter
            valid[r, : lengths[i]] = True
        return {"input_ids": ids, "valid": valid, "index": torch.tensor(batch_ids)}

    one_by_one = diffusion_elbo(model, [padded([i], lengths[i]) for i in range(4)], **kw)
    all_at_once = diffusion_elbo(model, [padded([0, 1, 2, 3], 9)], **kw)
    reordered = diffusion_elbo(model, [padded([3, 1], 7), padded([2, 0], 6)], **kw)
    for other in (all_at_once, reordered):
        assert other.num_tokens == one_by_one.num_tokens == sum(lengths)
        assert other.nll_per_token == pytest.approx(one_by_one.nll_per_token, rel=1e-6)
        assert other.stderr == pytest.approx(one_by_one.stderr, rel=1e-6)


def test_every_model_sees_the_same_masks():
    seen = {"a": [], "b": []}

    def recorder(name, model):
        def fn(ids, valid):
            seen[name].append(ids.clone())
            return model(ids, valid)

        return fn

    batch = {"input_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 0, 1]]), "index": torch.tensor([7])}
    diffusion_elbo(recorder("a", ContextModel(1.0)), [batch], MASK, 6, seed=2)
    diffusion_elbo(recorder("b", ContextModel(0.1)), [batch], MASK, 6, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(seen["a"], seen["b"]))
    assert len({tuple(x.flatten().tolist()) for x in seen["a"]}) > 1  # the masks do vary by sample


def test_shift_realigns_dream_logits():
    ids = torch.tensor([[1, 1, 0, 2, 0]])  # x0 == x1: Dream's position 0 reuses logits meant for x1
    valid = torch.ones_like(ids, dtype=torch.bool)

    def next_token_oracle(x, v):  # position i is confident about token i + 1
        nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
        return 30.0 * torch.nn.functional.one_hot(nxt, V + 1).float()

    kw = dict(mask_id=MASK, num_samples=4, seed=0)
    realigned = sequence_losses(next_token_oracle, ids, valid, torch.tensor([0]), shift=True, **kw)
    unaligned = sequence_losses(next_token_oracle, ids, valid, torch.tensor([0]), **kw)
    assert realigned.max() < 1e-6
    assert unaligned.max() > 1.0


def test_rejects_samples_not_divisible_by_group():
    with pytest.raises(ValueError, match="divisible by 2"):
        ids = torch.zeros(1, 3, dtype=torch.long)
        sequence_losses(ContextModel(), ids, ids == 0, torch.tensor([0]), MASK, 5, 0, t_sampling="antithetic")


def test_antithetic_pairs_use_mirrored_noise_levels():
    fractions = []

    def recorder(ids, valid):
        fractions.append(float((ids == MASK).float().mean()))
        return torch.zeros(*ids.shape, V)

    ids = torch.zeros(1, 4000, dtype=torch.long)
    valid = torch.ones_like(ids, dtype=torch.bool)
    sequence_losses(recorder, ids, valid, torch.tensor([0]), MASK, 8, 0, eps=EPS, t_sampling="antithetic")
    pair_sums = [fractions[k] + fractions[k + 1] for k in range(0, 8, 2)]
    assert all(abs(s - (1 + EPS)) < 0.05 for s in pair_sums), pair_sums  # p(t) + p(1 - t) = 1 + eps
    assert max(fractions) - min(fractions) > 0.1


def test_stratified_groups_spread_noise_levels():
    fractions = []

    def recorder(ids, valid):
        fractions.append(float((ids == MASK).float().mean()))
        return torch.zeros(*ids.shape, V)

    ids = torch.zeros(1, 4000, dtype=torch.long)
    valid = torch.ones_like(ids, dtype=torch.bool)
    sequence_losses(
        recorder, ids, valid, torch.tensor([0]), MASK, 8, 1, eps=EPS, t_sampling="stratified", group_size=4
    )
    for g in range(2):  # one noise level in each quarter of [0, 1) per group
        quarters = sorted(int(f / (1 + EPS) * 4) for f in fractions[4 * g : 4 * g + 4])
        assert quarters == [0, 1, 2, 3], fractions


def test_grouped_schemes_cut_the_error_when_noise_level_dominates():
    """A model that improves with visible context: X | t is nearly deterministic on a long sequence,
    so almost all variance is between noise levels, which antithetic/stratified t remove. The
    reported errors must show it (replicates are group means) and the estimates must agree."""
    L, vocab = 512, 4
    ids = torch.randint(0, vocab, (2, L))

    def context_oracle(x, valid):
        visible = (x != vocab).float().mean(dim=1, keepdim=True)[..., None]  # [B, 1, 1]
        return 4.0 * visible * torch.nn.functional.one_hot(ids, vocab + 1).float()  # [B, L, V+1]

    batch = [{"input_ids": ids}]
    res = {
        s: diffusion_elbo(context_oracle, batch, vocab, 64, seed=4, eps=EPS, t_sampling=s, group_size=8)
        for s in ("iid", "antithetic", "stratified")
    }
    assert res["antithetic"].stderr < 0.5 * res["iid"].stderr
    assert res["stratified"].stderr < 0.5 * res["iid"].stderr
    for s in ("antithetic", "stratified"):
        diff = abs(res[s].nll_per_token - res["iid"].nll_per_token)
        assert diff < 3.5 * math.hypot(res[s].stderr, res["iid"].stderr)


def test_unmaskable_positions_are_never_masked_nor_counted():
    inputs = []

    def recorder(ids, valid):
        inputs.append(ids.clone())
        return torch.zeros(*ids.shape, V)

    ids = torch.tensor([[1, 0, 2, 1, 0, 2]])
    maskable = torch.tensor([[False, True, True, True, True, False]])  # e.g. BOS and a last token
    res = diffusion_elbo(recorder, [{"input_ids": ids, "maskable": maskable}], MASK, 16, seed=0)
    assert res.num_tokens == 4
    noisy = torch.cat(inputs)
    assert (noisy[:, 0] == 1).all() and (noisy[:, 5] == 2).all()
    assert (noisy[:, 1:5] == MASK).any()
    assert res.nll_per_token == pytest.approx(math.log(V), rel=0.5)
