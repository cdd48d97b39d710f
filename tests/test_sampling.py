"""Sampler: the distributions it samples from (``probs``), per-row penalty state for verify rows, and the one-step
form's agreement with probs + sample."""
import pytest
import torch

from trapetum.runtime.sampling import GenerationSettings, Sampler


def settings(**kw):
    return GenerationSettings(**kw).validate()


@pytest.mark.parametrize("kw", [dict(temperature=0.8), dict(temperature=1.2, top_k=5), dict(temperature=0.7, top_p=0.8),
                                dict(temperature=1.0, min_p=0.1), dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02,
                                                                       repetition_penalty=1.3)])
def test_probs_are_normalized_and_respect_the_filters(kw):
    g = torch.Generator().manual_seed(0)
    s = Sampler(settings(seed=1, **kw), 64, prompt=[1, 2, 3])
    logits = torch.randn(5, 64, generator=g) * 3
    p = s.probs(logits)
    assert p.shape == (5, 64) and torch.allclose(p.sum(-1), torch.ones(5)) and (p >= 0).all()
    if kw.get("top_k"):
        assert ((p > 0).sum(-1) <= kw["top_k"]).all()
    if kw.get("min_p"):
        assert ((p == 0) | (p >= kw["min_p"] * p.amax(-1, keepdim=True) - 1e-7)).all()


def test_greedy_probs_are_one_hot_of_the_penalized_argmax():
    s = Sampler(settings(repetition_penalty=10.0), 8, prompt=[3])
    logits = torch.tensor([0.0, 1.0, 2.0, 5.0, 0.5, 0.0, 0.0, 0.0])
    p = s.probs(logits)
    assert p.shape == (1, 8) and p[0, 2] == 1.0 and p.sum() == 1.0  # token 3's 5.0 penalized to 0.5
    assert int(s(logits)) == 2


def test_verify_rows_see_the_drafts_before_them():
    """Row r of probs(logits [M, V], drafts) equals what a sampler that accepted drafts[:r] gives for that row."""
    g = torch.Generator().manual_seed(2)
    kw = dict(temperature=0.9, top_k=12, top_p=0.95, repetition_penalty=1.5, seed=0)
    logits = torch.randn(4, 40, generator=g) * 2
    drafts = torch.tensor([7, 9, 7])
    rows = Sampler(settings(**kw), 40, prompt=[1, 2]).probs(logits, drafts)
    for r in range(4):
        seq = Sampler(settings(**kw), 40, prompt=[1, 2])
        if r:
            seq.accept(drafts[:r])
        assert torch.equal(rows[r], seq.probs(logits[r])[0]), r
    # the state itself is unchanged by a multi-row call
    s = Sampler(settings(**kw), 40, prompt=[1, 2])
    before = s.seen.clone()
    s.probs(logits, drafts)
    assert torch.equal(s.seen, before)


def test_one_step_call_is_probs_then_sample_then_accept():
    kw = dict(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=5)
    g = torch.Generator().manual_seed(3)
    logits = [torch.randn(50, generator=g) for _ in range(6)]
    a = Sampler(settings(**kw), 50, prompt=[4])
    b = Sampler(settings(**kw), 50, prompt=[4])
    for lg in logits:
        t = a(lg)
        u = b.sample(b.probs(lg))
        b.accept(u)
        assert int(t) == int(u)
