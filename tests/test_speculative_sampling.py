"""Speculative sampling is exact in distribution: over 5,000 seeded runs the first three generated tokens of the
speculative runner (draft-model and n-gram drafters) follow plain sampling's distribution, which is computed exactly
by enumerating the tiny model's continuations (Sampler.probs, the plain runner's own distributions).

Chi-square goodness of fit: cells = token triples with an expected count of at least 5, the rest pooled into one
cell; the statistic must stay under the chi-square quantile at 1 - 1e-3 (Wilson-Hilferty approximation). Plain
sampling's own counts pass the same test (the enumeration is right) and fail it against the enumeration at a
temperature 0.05 higher, and an accept rule that draws from p instead of the residual after a rejection fails it
(the test has power).
"""
import itertools
import math

import pytest
import torch

import trapetum
from trapetum.runtime.sampling import GenerationSettings, Sampler
from trapetum.runtime.speculative import DraftModelDrafter, NgramDrafter, ReferenceRows, SpeculativeRunner, loop
from trapetum.runtime.speculative.accept import Verdict

RUNS = [5000]
PROMPT = [3, 9, 4, 17, 3, 9, 4, 17, 3, 9, 4]  # repeats, so the n-gram drafter proposes
SETTINGS = dict(temperature=0.7, top_p=0.9)
V = 32
NOISE = 0.2  # the drafter's head perturbation (acceptance ~0.6)
SCALE = 25.0  # the head scale: 42 triples with an expected count of 5 or more


def build_peaked(path, seed: int = 0, noise: float = 0.0):
    """A 2-layer Llama of vocabulary 32 whose head is scaled up, so that top-p 0.9 keeps a handful of tokens;
    ``noise``: its head perturbed by that fraction (a drafter that agrees with seed's model only in part)."""
    import transformers as T
    torch.manual_seed(seed)
    cfg = T.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = T.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(SCALE)
        w = model.lm_head.weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(99)) * w.std() * noise)
    model.save_pretrained(path, safe_serialization=True)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    a, b = tmp_path_factory.mktemp("peak0"), tmp_path_factory.mktemp("peak1")
    build_peaked(a)
    build_peaked(b, noise=NOISE)
    return trapetum.load(a), trapetum.load(b)


def exact_joint(decoder, s: GenerationSettings, n: int = 3) -> dict[tuple, float]:
    """P(first n tokens) under plain sampling, by enumeration of the supports."""
    out = {}

    def rec(prefix: list[int], prob: float, depth: int):
        if depth == n:
            out[tuple(prefix[len(PROMPT):])] = prob
            return
        with torch.inference_mode():
            logits = decoder(torch.tensor([prefix]))[0, -1]
        p = Sampler(s, V, prompt=prefix).probs(logits)[0].double()
        for t in torch.nonzero(p > 0).view(-1).tolist():
            rec(prefix + [t], prob * float(p[t]), depth + 1)

    rec(list(PROMPT), 1.0, 0)
    return out


def chi2_quantile(df: int, z: float = 3.0902) -> float:
    """Upper quantile of chi-square(df) at the normal quantile z (3.0902: 1 - 1e-3), Wilson-Hilferty."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2(counts: dict[tuple, int], exact: dict[tuple, float], runs: int) -> tuple[float, float]:
    """(statistic, threshold) of the goodness of fit of ``counts`` to ``exact``."""
    assert abs(sum(exact.values()) - 1.0) < 1e-6
    big = [c for c, p in exact.items() if p * runs >= 5]
    assert len(big) >= 10, "the test needs a spread-out distribution"
    assert sum(counts.values()) == runs
    stat = 0.0
    for c in big:
        e = exact[c] * runs
        stat += (counts.get(c, 0) - e) ** 2 / e
    rest_e = runs - sum(exact[c] * runs for c in big)
    rest_o = runs - sum(counts.get(c, 0) for c in big)
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
    df = len(big) - (0 if rest_e > 0 else 1)
    return stat, chi2_quantile(df)


def first3(runner, seed: int) -> tuple:
    s = GenerationSettings(max_new_tokens=3, seed=seed, **SETTINGS)
    return tuple(itertools.islice(runner.tokens(list(PROMPT), s, len(PROMPT) + 6), 3))


def counts_of(runner, runs: int) -> dict[tuple, int]:
    c: dict[tuple, int] = {}
    for seed in range(runs):
        t = first3(runner, seed)
        c[t] = c.get(t, 0) + 1
    return c


@pytest.fixture(scope="module")
def exact(models):
    return exact_joint(models[0].decoder, GenerationSettings(**SETTINGS))


@pytest.mark.parametrize("runs", RUNS)
def test_plain_sampling_matches_the_enumeration(models, exact, runs):
    """Plain sampling's own counts fit the enumeration, and do not fit that of a temperature 0.1 higher."""
    m = models[0]
    c = counts_of(m.runner, runs)
    assert all(t in exact for t in c), "a sampled triple has probability 0 under the enumeration"
    stat, thr = chi2(c, exact, runs)
    assert stat < thr, (stat, thr)
    warmer = exact_joint(m.decoder, GenerationSettings(temperature=0.8, top_p=0.9))
    stat, thr = chi2(c, warmer, runs)
    assert stat > thr, (stat, thr)


@pytest.mark.parametrize("runs", RUNS)
@pytest.mark.parametrize("kind", [pytest.param("draft", marks=pytest.mark.slow), "ngram"])  # draft: 70 s on the CPU
def test_speculative_sampling_matches_plain(models, exact, kind, runs):
    m, other = models
    drafter = DraftModelDrafter(ReferenceRows(other.decoder)) if kind == "draft" else NgramDrafter(max_n=4, min_n=1)
    runner = SpeculativeRunner(ReferenceRows(m.decoder), drafter, k=2)
    c: dict[tuple, int] = {}
    drafted = accepted = 0
    for seed in range(runs):
        t = first3(runner, seed)
        c[t] = c.get(t, 0) + 1
        drafted += runner.stats.drafted
        accepted += runner.stats.accepted
    assert 0.05 < accepted / drafted < 0.95, (accepted, drafted)  # both the accept and the residual branch ran
    assert all(t in exact for t in c), "a sampled triple has probability 0 under plain sampling"
    stat, thr = chi2(c, exact, runs)
    assert stat < thr, (stat, thr)


def residual_from_p(sampler, logits, greedy_rows, drafts, q):
    """The accept rule with a classic bug: after a rejection the token is drawn from p, not the residual."""
    k = drafts.shape[0]
    p = sampler.probs(logits, drafts)
    ar = torch.arange(k)
    qd = q[ar, drafts] if q is not None else torch.ones(k)
    ok = torch.rand(k, generator=sampler.gen) * qd < p[ar, drafts]
    x = torch.multinomial(p, 1, generator=sampler.gen).view(-1)
    n = 0
    while n < k and bool(ok[n]):
        n += 1
    em = torch.cat([drafts[:n], x[n:n + 1]])
    return Verdict(em.tolist(), n, em)


@pytest.mark.slow  # 21 s: the power check of the distribution test (it must fail on a wrong residual)
def test_a_wrong_residual_is_detected(models, exact, monkeypatch):
    m, other = models
    monkeypatch.setattr(loop, "judge", residual_from_p)
    runner = SpeculativeRunner(ReferenceRows(m.decoder), DraftModelDrafter(ReferenceRows(other.decoder)), k=2)
    runs = 1500
    stat, thr = chi2(counts_of(runner, runs), exact, runs)
    assert stat > thr, (stat, thr)


def test_sampling_is_reproducible_with_a_seed(models):
    m, other = models
    for drafter in (DraftModelDrafter(ReferenceRows(other.decoder)), NgramDrafter(min_n=1)):
        runner = SpeculativeRunner(ReferenceRows(m.decoder), drafter, k=4)
        s = GenerationSettings(max_new_tokens=20, seed=11, temperature=0.9, top_k=10, min_p=0.02,
                               repetition_penalty=1.2)
        a = list(runner.tokens(list(PROMPT), s, len(PROMPT) + 20))
        b = list(runner.tokens(list(PROMPT), s, len(PROMPT) + 20))
        other_seed = [list(runner.tokens(list(PROMPT), GenerationSettings(**{**vars(s), "seed": x}),
                                         len(PROMPT) + 20)) for x in range(12, 16)]
        assert a == b and len(a) == 20
        assert any(o != a for o in other_seed)


def pipelined_drafters(other, copy_):
    from trapetum.runtime.speculative import Drafter, PardDrafter, ScriptedDrafter
    script = torch.tensor(PROMPT + [3, 9, 4, 17] * 8)
    return {"draft": lambda: DraftModelDrafter(ReferenceRows(other.decoder)),
            "draft-self": lambda: DraftModelDrafter(ReferenceRows(copy_.decoder)),
            "pard": lambda: PardDrafter(ReferenceRows(other.decoder), 5),
            "scripted": lambda: ScriptedDrafter(script), "none": lambda: Drafter()}


@pytest.fixture(scope="module")
def copy_model(models, tmp_path_factory):
    return trapetum.load(models[0].path)


PENALTY = dict(temperature=0.9, top_k=10, min_p=0.02, repetition_penalty=1.2)


@pytest.mark.parametrize("settings,seeds", [(SETTINGS, 10), (PENALTY, 10),
                                            pytest.param(SETTINGS, 60, marks=pytest.mark.slow),
                                            pytest.param(PENALTY, 60, marks=pytest.mark.slow)],
                         ids=["t0.7-p0.9", "topk-minp-penalty", "t0.7-p0.9-60", "topk-minp-penalty-60"])
def test_pipelined_sampling_draws_what_the_synchronous_loop_draws(models, copy_model, settings, seeds):
    """With a fixed k the pipelined loop (pipeline.py) makes the synchronous loop's random draws in the same order,
    so under the same seed it yields the same tokens (hence, by the chi-square tests above, plain sampling's
    distribution): 5 drafters x k in (1, 2, 5) x 10 seeds (60 in the slow tier), 12 tokens each, with room past the end of the cache (the
    two loops bound k differently there)."""
    m, other = models
    rows = ReferenceRows(m.decoder)
    cases = accepted = drafted = 0
    for name, mk in pipelined_drafters(other, copy_model).items():
        for k in (1, 2, 5):
            for seed in range(seeds):
                s = GenerationSettings(max_new_tokens=12, seed=seed, **settings)
                outs, stats = [], []
                for pipelined in (False, True):
                    r = SpeculativeRunner(rows, mk(), k, pipelined=pipelined)
                    g = r.tokens(list(PROMPT), s, len(PROMPT) + 12 + 2 * k + 2)
                    outs.append(list(itertools.islice(g, 12)))
                    g.close()
                    stats.append((r.stats.rounds, r.stats.accepted, r.stats.accepted_hist))
                assert outs[0] == outs[1] and stats[0] == stats[1], (name, k, seed, settings)
                accepted += r.stats.accepted
                drafted += r.stats.drafted
                cases += 1
    assert cases == 5 * 3 * seeds and 0.1 < accepted / drafted < 0.9  # both branches of the accept rule ran


def test_pipelined_adaptive_sampling_is_reproducible(models):
    m, other = models
    runner = SpeculativeRunner(ReferenceRows(m.decoder), DraftModelDrafter(ReferenceRows(other.decoder)), k=3,
                               adaptive=True, pipelined=True)
    s = GenerationSettings(max_new_tokens=24, seed=3, **SETTINGS)
    a = list(runner.tokens(list(PROMPT), s, len(PROMPT) + 24))
    b = list(runner.tokens(list(PROMPT), s, len(PROMPT) + 24))
    assert a == b and len(a) == 24


@pytest.mark.slow
@pytest.mark.parametrize("runs", RUNS)
def test_pipelined_speculative_sampling_matches_plain(models, exact, runs):
    """The chi-square test of test_speculative_sampling_matches_plain through the pipelined loop (draft model)."""
    m, other = models
    runner = SpeculativeRunner(ReferenceRows(m.decoder), DraftModelDrafter(ReferenceRows(other.decoder)), k=2,
                               pipelined=True)
    c = counts_of(runner, runs)
    assert all(t in exact for t in c)
    stat, thr = chi2(c, exact, runs)
    assert stat < thr, (stat, thr)
