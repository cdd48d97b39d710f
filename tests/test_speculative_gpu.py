"""Exact speculative decoding on the GPU engine (CUDA graphs): greedy speculative output equals plain greedy output
token for token, for every drafter kind and adversarial drafters, on random-weight models at real per-layer shapes
(2 layers; real-size heads: Llama-2 32k MHA, Llama-3 128k GQA, Qwen2.5 152k with qkv bias and a tied head; fp16,
4-bit codebooks and AQLM 2x8 targets) and on the real SmolLM2-135M. The matrix runs the pipelined loop
(runtime/speculative/pipeline.py) wherever it can run (every drafter but n-gram lookup; the default loop is the
synchronous one, which session 8 ran through the same matrix); the tests at the end compare the two loops round for
round and check that the pipelined rounds never synchronize. Skipped without CUDA.

    python -m pytest -q -m gpu tests/test_speculative_gpu.py
"""
import itertools

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from trapetum.eval.random_model import random_checkpoint  # noqa: E402
from trapetum.runtime.sampling import GenerationSettings  # noqa: E402
from trapetum.runtime.speculative import (ConstantDrafter, DraftModelDrafter, EngineRows, NgramDrafter,  # noqa: E402
                                          OverlongDrafter, PardDrafter, RandomDrafter, ScriptedDrafter,
                                          SpeculativeRunner)

# (target shape, target format, drafter shape, drafter format)
PAIRS = [("llama2-7b", "fp16", "llama2-7b", "cb4"), ("llama2-7b", "cb4", "llama2-7b", "aqlm-2x8"),
         ("llama2-7b", "aqlm-2x8", "llama2-7b", "cb4"), ("llama3-8b", "cb4", "llama3.2-1b", "cb4"),
         ("llama3-8b", "fp16", "llama3.2-1b", "cb4"), ("qwen2.5-0.5b", "cb4", "qwen2.5-0.5b", "fp16")]
KS = (1, 3, 7, 15)
NEW = 48
MAX_LEN = 160


def engine(shape, fmt):
    from trapetum.runtime.engine import GpuEngine
    return GpuEngine(random_checkpoint(shape, fmt, layers=2), MAX_LEN, device="cuda")


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}")
def test_greedy_matrix_engine(pair):
    """9 drafters x K in (1, 3, 7, 15) x 2 prompts = 72 cases per pair."""
    te, de = engine(*pair[:2]), engine(*pair[2:])
    V = te.cfg.vocab_size
    assert de.cfg.vocab_size == V
    g = torch.Generator().manual_seed(0)
    cases = 0
    for pi, n in enumerate((20, 70)):
        prompt = torch.randint(3, V, (n,), generator=g).tolist()
        s = GenerationSettings(max_new_tokens=NEW)
        plain = list(te.tokens(prompt, s, n + NEW))
        truth = prompt + plain
        for k in KS:
            for d in (NgramDrafter(min_n=1), DraftModelDrafter(EngineRows(de)), PardDrafter(EngineRows(de), V - 1),
                      ScriptedDrafter.modeled(truth, 1.0, V, device="cuda"),
                      ScriptedDrafter.modeled(truth, 0.0, V, device="cuda"),
                      ScriptedDrafter.modeled(truth, 0.5, V, seed=pi, device="cuda"),
                      RandomDrafter(V, seed=k), ConstantDrafter(plain[NEW // 2]),
                      OverlongDrafter(ScriptedDrafter.modeled(truth, 1.0, V, device="cuda"), 9)):
                r = SpeculativeRunner(EngineRows(te), d, k, pipelined=SpeculativeRunner.can_pipeline(EngineRows(te), d))
                got = list(r.tokens(prompt, s, n + NEW))
                assert got == plain, (pair, d.name, k, pi)
                if d.name in ("scripted", "overlong") and r.stats.accepted == r.stats.drafted:
                    assert r.stats.tokens_per_round > min(k, 4)  # the oracle's rounds emit k + 1 tokens
                cases += 1
    assert cases == 72


def test_draft_model_of_the_same_weights_accepts_everything():
    """A second engine of the same checkpoint drafts exactly the target's greedy tokens (same kernels, same bits)."""
    te, de = engine("llama3-8b", "cb4"), engine("llama3-8b", "cb4")
    prompt = list(range(5, 40))
    s = GenerationSettings(max_new_tokens=64)
    plain = list(te.tokens(prompt, s, len(prompt) + 64))
    for k in (3, 7, 15):
        for pipe in (True, False):
            r = SpeculativeRunner(EngineRows(te), DraftModelDrafter(EngineRows(de)), k, pipelined=pipe)
            assert list(r.tokens(prompt, s, len(prompt) + 64)) == plain
            assert r.stats.acceptance == 1.0, r.stats


def test_sampling_on_the_gpu_is_seeded():
    te, de = engine("llama3-8b", "cb4"), engine("llama3.2-1b", "cb4")
    prompt = list(range(5, 30))
    s = GenerationSettings(max_new_tokens=40, temperature=0.8, top_p=0.9, top_k=50, min_p=0.01,
                           repetition_penalty=1.1, seed=4)
    for d in (DraftModelDrafter(EngineRows(de)), PardDrafter(EngineRows(de), 7), NgramDrafter(min_n=1)):
        r = SpeculativeRunner(EngineRows(te), d, 5)
        a = list(r.tokens(prompt, s, len(prompt) + 40))
        b = list(r.tokens(prompt, s, len(prompt) + 40))
        assert a == b and len(a) == 40


def test_real_smollm2_on_the_gpu():
    """The real SmolLM2-135M on the engine: n-gram, PARD-style (its EOS as the mask token: exactness only), a second
    copy of itself (acceptance 1), over the benchmark's prompt set; completions equal plain ones."""
    from tests.real_models import require
    import trapetum
    from trapetum.eval.spec_prompts import PROMPTS, encode
    path = require("smollm2")
    copy_ = trapetum.load(path, device="cuda")
    cases = 0
    for draft, k in (("ngram", 3), ("ngram", 7), (copy_, 7), (f"pard:{path}", 3)):
        spec = trapetum.load(path, device="cuda", draft=draft, draft_k=k,
                             draft_mask_token=copy_.tokenizer.eos_ids[0] if str(draft).startswith("pard") else None)
        for _, _, chat, text in PROMPTS:
            ids = encode(spec, chat, text)
            want = spec.generate(ids, max_new_tokens=64, speculative=False)
            got = spec.generate(ids, max_new_tokens=64)
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
            if draft is copy_:
                assert spec.speculative.stats.acceptance == 1.0
            cases += 1
    assert cases == 48


def _first(runner, prompt, s, max_len):
    g = runner.tokens(prompt, s, max_len)
    out = list(itertools.islice(g, s.max_new_tokens))
    g.close()
    st = runner.stats
    return out, (st.rounds, st.drafted, st.accepted, st.produced, st.accepted_hist)


def test_pipelined_equals_synchronous_on_the_engine():
    """The pipelined loop (chosen automatically here) against the synchronous one on the engine: greedy, the same
    tokens as plain decoding and the same rounds (the same drafts and verdicts) for PARD, the draft model and
    scripted drafters over a PARD pass, K in (1, 3, 7, 15): 48 cases; sampling (fixed k): the same tokens under the
    same seed, 3 drafters x 2 K x 4 seeds. With room past the end of the cache (the loops bound k differently
    there)."""
    te, de = engine("llama3-8b", "cb4"), engine("llama3.2-1b", "cb4")
    V = te.cfg.vocab_size
    cases = 0
    for pi, n in enumerate((20, 70)):
        prompt = torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(pi)).tolist()
        s = GenerationSettings(max_new_tokens=NEW)
        plain = list(te.tokens(prompt, s, n + NEW))
        truth = prompt + plain
        far = n + NEW + 2 * max(KS) + 2
        for k in KS:
            for mk in (lambda: PardDrafter(EngineRows(de), V - 1), lambda: DraftModelDrafter(EngineRows(de)),
                       lambda: ScriptedDrafter.modeled(truth, 0.8, V, seed=k, device="cuda",
                                                       inner=PardDrafter(EngineRows(de), V - 1)),
                       lambda: ScriptedDrafter.modeled(truth, 0.5, V, seed=k, device="cuda",
                                                       inner=DraftModelDrafter(EngineRows(de)))):
                auto = SpeculativeRunner(EngineRows(te), mk(), k, pipelined=True)
                assert SpeculativeRunner.can_pipeline(EngineRows(te), mk())
                got = list(auto.tokens(prompt, s, n + NEW))
                a = _first(SpeculativeRunner(EngineRows(te), mk(), k, pipelined=True), prompt, s, far)
                b = _first(SpeculativeRunner(EngineRows(te), mk(), k, pipelined=False), prompt, s, far)
                assert got == plain and a == b and a[0] == plain, (k, pi, a[1], b[1])
                cases += 1
    assert cases == 2 * 4 * 4
    prompt = list(range(5, 30))
    for mk in (lambda: PardDrafter(EngineRows(de), 7), lambda: DraftModelDrafter(EngineRows(de)),
               lambda: ScriptedDrafter.modeled(prompt + list(range(40)), 0.5, V, device="cuda")):
        for k in (2, 7):
            for seed in range(4):
                s = GenerationSettings(max_new_tokens=40, temperature=0.8, top_p=0.9, top_k=50, min_p=0.01,
                                       repetition_penalty=1.1, seed=seed)
                far = len(prompt) + 40 + 2 * k + 2
                a = _first(SpeculativeRunner(EngineRows(te), mk(), k, pipelined=True), prompt, s, far)
                b = _first(SpeculativeRunner(EngineRows(te), mk(), k, pipelined=False), prompt, s, far)
                assert a == b and len(a[0]) == 40, (k, seed)


def test_pipelined_rounds_never_synchronize(monkeypatch):
    """torch's sync debug mode set to error from the drafter's begin (after both prefills) to the end of the
    generation, except inside the loop's own read-back (Reader.recv waits on the round's event): any hidden
    synchronization in a round (a .item(), a pageable copy, a host-side index) raises. PARD and the draft model,
    greedy and sampling (sampling only where torch.multinomial itself does not synchronize: older torch versions
    check the distribution with an .item(); the probe below says which)."""
    from trapetum.runtime.speculative import pipeline
    te, de = engine("llama3-8b", "cb4"), engine("llama3.2-1b", "cb4")
    V = te.cfg.vocab_size
    recv = pipeline.Reader.recv

    def quiet_recv(ticket):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return recv(ticket)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(pipeline.Reader, "recv", staticmethod(quiet_recv))

    def strict(d):
        begin = d.begin

        def begin_then_strict(*a, **kw):
            begin(*a, **kw)
            torch.cuda.set_sync_debug_mode("error")
        d.begin = begin_then_strict
        return d

    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.multinomial(torch.ones(2, 4, device="cuda"), 1)
        multinomial_syncs = False
    except RuntimeError:
        multinomial_syncs = True
    finally:
        torch.cuda.set_sync_debug_mode(0)
    prompt = list(range(5, 40))
    settings = [GenerationSettings(max_new_tokens=40)]
    if not multinomial_syncs:
        settings.append(GenerationSettings(max_new_tokens=40, temperature=0.8, top_p=0.9, repetition_penalty=1.1,
                                           seed=1))
    for s in settings:
        for d in (PardDrafter(EngineRows(de), V - 1), DraftModelDrafter(EngineRows(de)),
                  ScriptedDrafter.modeled(prompt + list(range(50)), 0.8, V, device="cuda",
                                          inner=PardDrafter(EngineRows(de), V - 1))):
            r = SpeculativeRunner(EngineRows(te), strict(d), 7, pipelined=True)
            assert r.pipelined
            try:
                out = list(r.tokens(prompt, s, len(prompt) + 40))
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert len(out) == 40 and r.stats.rounds >= 5
