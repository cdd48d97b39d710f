"""The pipelined speculative loop (runtime/speculative/pipeline.py) on the CPU: round r + 1 queued before round r's
verdict is read back, the verdict, the drafters' inputs and the positions computed from tensors (here CPU tensors,
so CI runs the device-side path). Greedy output equals plain greedy output token for token, and the rounds equal
the synchronous loop's (the same drafts, the same verdicts: equal stats), for PARD, draft models, scripted and
adversarial drafters, on the reference decoder (three families) and the engine; EOS, stop strings, max tokens and
the context end as in plain decoding; K = 1 .. 15 and adaptive K; the automatic switch; the claim that cache rows
written past the sequence are rewritten before anything reads them. Sampling: tests/test_speculative_sampling.py.
"""
import copy
import itertools

import pytest
import torch

import trapetum
from tests.test_speculative import EOS, MASK, V, completion, load_trios, prompts_for
from tests.tiny_models import build_cbk
from trapetum.runtime.engine import GpuEngine
from trapetum.runtime.sampling import GenerationSettings
from trapetum.runtime.speculative import (ConstantDrafter, Drafter, DraftModelDrafter, EngineRows, NgramDrafter,
                                          OverlongDrafter, PardDrafter, RandomDrafter, ReferenceRows,
                                          ScriptedDrafter, SpeculativeRunner)
from trapetum.settings import Options

FAMILIES = ["llama3", "mistral", "gemma2"]
KS = (1, 3, 7, 15)

pytestmark = pytest.mark.usefixtures("torch_fallbacks", "one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_trios(tmp_path_factory, FAMILIES)


def drafters(other, copy_, truth, seed):
    return {
        "pard-other": lambda: PardDrafter(ReferenceRows(other.decoder), MASK),
        "pard-self": lambda: PardDrafter(ReferenceRows(copy_.decoder), MASK),  # draft 1 right, the rest seldom
        "draft-other": lambda: DraftModelDrafter(ReferenceRows(other.decoder)),
        "draft-self": lambda: DraftModelDrafter(ReferenceRows(copy_.decoder)),  # always right
        "right": lambda: ScriptedDrafter.modeled(truth, 1.0, V),
        "wrong": lambda: ScriptedDrafter.modeled(truth, 0.0, V, seed=seed),
        "half": lambda: ScriptedDrafter.modeled(truth, 0.5, V, seed=seed),
        "random": lambda: RandomDrafter(V, seed),
        "eos": lambda: ConstantDrafter(EOS),
        "overlong": lambda: OverlongDrafter(ScriptedDrafter.modeled(truth, 1.0, V), extra=7),
        "none": lambda: Drafter(),  # proposes nothing: one verify row a round
    }


def run(rows, drafter, prompt, s, k, pipelined, max_len=None, adaptive=False):
    """(tokens, stats): the first max_new_tokens tokens of a generation with room for ``max_len`` positions."""
    r = SpeculativeRunner(rows, drafter, k, adaptive=adaptive, pipelined=pipelined)
    gen = r.tokens(prompt, s, max_len or len(prompt) + s.max_new_tokens)
    out = list(itertools.islice(gen, s.max_new_tokens))
    gen.close()
    return out, r.stats


def same_rounds(a, b) -> bool:
    return (a.rounds, a.drafted, a.accepted, a.produced, a.accepted_hist) == (
        b.rounds, b.drafted, b.accepted, b.produced, b.accepted_hist)


MATRIX = [pytest.param("llama3", 1, id="llama3", marks=pytest.mark.slow),  # 21 s; test_pipelined_engine_matrix stays
          pytest.param("llama3", 2, id="llama3-both-prompts", marks=pytest.mark.slow),
          pytest.param("mistral", 2, id="mistral", marks=pytest.mark.slow),
          pytest.param("gemma2", 2, id="gemma2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("family,n_prompts", MATRIX)
def test_pipelined_greedy_matrix_reference(tiny, family, n_prompts):
    """11 drafters x K in (1, 3, 7, 15) x 2 prompts, greedy, and 4 drafters x 4 K x 2 prompts with a repetition
    penalty (112 cases per family; the default tier runs one prompt of llama3, 56 cases): the same tokens as plain
    decoding, the pipelined loop with the cache ending at the last token and with room to spare; there (where the
    two loops bound k alike) also the same rounds as the synchronous loop."""
    target, other, copy_ = tiny[family]
    rows = ReferenceRows(target.decoder, target.context_size)
    cases = 0
    for s, names in ((GenerationSettings(max_new_tokens=20, ignore_eos=True), None),
                     (GenerationSettings(max_new_tokens=12, ignore_eos=True, repetition_penalty=1.3),
                      ("pard-other", "draft-self", "half", "random"))):
        for pi, prompt in enumerate(prompts_for(len(family))[:n_prompts]):
            plain = target.generate(prompt, s, speculative=False).token_ids
            ds = drafters(other, copy_, prompt + plain, pi)
            for name in names or ds:
                for k in KS:
                    got, st = run(rows, ds[name](), prompt, s, k, True) if k in (1, 15) or n_prompts > 1 else (
                        plain, None)
                    assert got == plain, (family, name, k, pi, s.repetition_penalty)
                    far = len(prompt) + s.max_new_tokens + 2 * k + 2
                    got2, st2 = run(rows, ds[name](), prompt, s, k, True, max_len=far)
                    want2, sync2 = run(rows, ds[name](), prompt, s, k, False, max_len=far)
                    assert got2 == want2 == plain and same_rounds(st2, sync2), (family, name, k, pi, st2, sync2)
                    if name == "draft-self" and s.repetition_penalty == 1.0:
                        assert st2.acceptance == 1.0 and st2.produced >= s.max_new_tokens - 1, (name, k, st2)
                    if name in ("right", "overlong"):  # all right but past the script's end (token 0)
                        assert st2.rounds <= -(-s.max_new_tokens // (k + 1)) + 1, (name, k, st2)
                    if name == "wrong":
                        assert st2.accepted == 0 and st2.drafted > 0, (k, st2)
                    cases += 1
    assert cases == n_prompts * (11 * 4 + 4 * 4)


def test_pipelined_engine_matrix(tmp_path, tiny):
    """The engine's data path (verify_at: the position from a tensor) on its torch fallbacks: fp16 and 4-bit .cbk
    targets, PARD / draft-model drafter engines and scripted drafters, K in (2, 7, 15): 2 x 5 x 3 = 30 cases."""
    target, other, _ = tiny["llama3"]
    cbk = trapetum.load(build_cbk("llama3", tmp_path, iters=3))
    cases = 0
    for tm, dm in ((target, other), (cbk, target)):
        te = GpuEngine(tm.checkpoint, 96, device="cpu", options=Options())
        de = GpuEngine(dm.checkpoint, 96, device="cpu", options=Options())
        s = GenerationSettings(max_new_tokens=18)
        prompt = prompts_for(3)[1]
        plain = list(te.tokens(prompt, s, len(prompt) + 18))
        truth = prompt + plain
        for name, mk in (("draft", lambda: DraftModelDrafter(EngineRows(de))),
                         ("pard", lambda: PardDrafter(EngineRows(de), MASK)),
                         ("half", lambda: ScriptedDrafter.modeled(truth, 0.5, V, seed=1)),
                         ("right", lambda: ScriptedDrafter.modeled(truth, 1.0, V)),
                         ("half-pard", lambda: ScriptedDrafter.modeled(truth, 0.5, V, seed=2,
                                                                       inner=PardDrafter(EngineRows(de), MASK)))):
            for k in (2, 7, 15):
                got, st = run(EngineRows(te), mk(), prompt, s, k, True)
                assert got == plain, (tm.path, name, k)
                if name == "right":  # drafts past max_len are verified (the engine's cache has room) but not counted
                    assert st.acceptance == 1.0 and st.rounds == -(-17 // (k + 1)), (k, st)
                cases += 1
    assert cases == 30


def test_pipelined_eos_stop_strings_and_max_tokens(tiny):
    """Drafts containing EOS or a stop string, or running past max_new_tokens, through stream_tokens: the same
    completion as plain decoding (the round queued past the stop is discarded)."""
    target, other, copy_ = tiny["mistral"]
    rows = ReferenceRows(target.decoder, target.context_size)
    prompt = target.encode("the quick brown fox jumps")
    plain = target.generate(prompt, GenerationSettings(max_new_tokens=40, ignore_eos=True), speculative=False)
    truth = prompt + plain.token_ids
    idx = next(i for i, t in enumerate(plain.token_ids) if i >= 4 and t not in plain.token_ids[:i])
    tk = copy.copy(target.tokenizer)
    tk.eos_ids = [plain.token_ids[idx]]
    stop = plain.text[len(plain.text) // 2: len(plain.text) // 2 + 3]
    settings = [GenerationSettings(max_new_tokens=40), GenerationSettings(max_new_tokens=40, stop=[stop]),
                *[GenerationSettings(max_new_tokens=n, ignore_eos=True) for n in (1, 2, 3, 5, 9)]]
    cases = 0
    for s in settings:
        want = completion(target.runner, target, prompt, s, tk)
        for k in (1, 4, 15):
            for d in (ScriptedDrafter.modeled(truth, 1.0, V), ConstantDrafter(tk.eos_ids[0]),
                      DraftModelDrafter(ReferenceRows(copy_.decoder)), PardDrafter(ReferenceRows(other.decoder), MASK),
                      OverlongDrafter(ScriptedDrafter.modeled(truth, 1.0, V), 20)):
                got = completion(SpeculativeRunner(rows, d, k, pipelined=True), target, prompt, s, tk)
                assert got == want, (s, k, d.name)
                cases += 1
    assert cases == 7 * 3 * 5
    first = completion(target.runner, target, prompt, settings[0], tk)
    assert first[2] == "stop" and len(first[1]) == idx


def test_pipelined_context_end_and_short_drafters(tiny):
    """Up to the last position of a 64-position cache, K = 15 and K = 3, drafters whose caches are shorter (40)."""
    target, other, copy_ = tiny["gemma2"]
    ctx = 64
    rows = ReferenceRows(target.decoder, ctx)
    for prompt in (prompts_for(5)[0], [1] + [7] * 40):
        n = ctx - len(prompt)
        s = GenerationSettings(max_new_tokens=n, ignore_eos=True)
        plain = target.generate(prompt, s, speculative=False).token_ids
        for d, k in ((ScriptedDrafter.modeled(prompt + plain, 1.0, V), 15), (ScriptedDrafter.modeled(prompt + plain, 1.0, V), 3),
                     (DraftModelDrafter(ReferenceRows(copy_.decoder)), 15),
                     (DraftModelDrafter(ReferenceRows(copy_.decoder, max_len=50)), 7),
                     (PardDrafter(ReferenceRows(copy_.decoder), MASK), 15),
                     (PardDrafter(ReferenceRows(other.decoder, max_len=50), MASK), 3)):
            got, st = run(rows, d, prompt, s, k, True)
            assert got == plain, (d.name, k, len(prompt))
            if d.name == "scripted":
                assert st.acceptance == 1.0


def test_pipelined_adaptive_k(tiny):
    target, _, copy_ = tiny["llama3"]
    rows = ReferenceRows(target.decoder, target.context_size)
    prompt = prompts_for(1)[1]
    s = GenerationSettings(max_new_tokens=60, ignore_eos=True)
    plain = target.generate(prompt, s, speculative=False).token_ids
    for alpha in (1.0, 0.0, 0.5):
        got, st = run(rows, ScriptedDrafter.modeled(prompt + plain, alpha, V, seed=2), prompt, s, 2, True,
                      adaptive=True)
        assert got == plain
        if alpha == 1.0:  # k grows (one round late): fewer rounds than at a fixed k = 2 (20)
            assert st.rounds < 12 and max(i for i, c in enumerate(st.accepted_hist) if c) > 2
        if alpha == 0.0:
            assert st.drafted <= st.rounds + 2  # k fell to 1 after the first verdicts
    got, _ = run(rows, DraftModelDrafter(ReferenceRows(copy_.decoder)), prompt, s, 3, True, adaptive=True)
    assert got == plain


def test_the_switch(tiny):
    """The default is the synchronous loop; ``can_pipeline``: when the target's rows read device positions on CUDA and
    the drafter proposes from device tensors alone; never for n-gram lookup (forcing it is an error) or the CPU
    reference rows."""
    target, other, _ = tiny["llama3"]
    ref = ReferenceRows(target.decoder)
    eng = EngineRows(GpuEngine(other.checkpoint, 64, device="cpu", options=Options()))
    assert not SpeculativeRunner(ref, PardDrafter(ref, MASK), 3).pipelined
    assert not SpeculativeRunner(eng, ScriptedDrafter(torch.zeros(4, dtype=torch.long)), 3).pipelined  # CPU
    assert SpeculativeRunner(ref, PardDrafter(ref, MASK), 3, pipelined=True).pipelined
    with pytest.raises(ValueError, match="host"):
        SpeculativeRunner(ref, NgramDrafter(), 3, pipelined=True)

    class CudaRows:  # what the switch reads of a GPU engine's rows
        device_positions = True
        device = torch.device("cuda")

    t = CudaRows()
    can = SpeculativeRunner.can_pipeline
    assert not SpeculativeRunner(t, PardDrafter(eng, MASK), 3).pipelined  # the default: synchronous
    assert can(t, PardDrafter(eng, MASK))
    assert can(t, DraftModelDrafter(eng))
    assert can(t, ScriptedDrafter(torch.zeros(4, dtype=torch.long)))
    assert not can(t, NgramDrafter())
    assert not can(t, PardDrafter(ref, MASK))  # a reference drafter reads back
    assert not can(t, ScriptedDrafter(torch.zeros(4, dtype=torch.long), inner=NgramDrafter()))
    assert not can(ref, PardDrafter(ref, MASK)) and not can(eng, PardDrafter(eng, MASK))  # CPU rows


@pytest.mark.parametrize("kind", ["reference", "engine"])
def test_rows_written_past_the_sequence_are_rewritten_before_read(tiny, kind):
    """The claim the pipelined loop's padding rests on: after a pass that wrote junk rows past position p, passes
    from p + 1 on give bitwise what they give when the junk was never written (a forward reads positions up to its
    own only, and writes its own first)."""
    target, _, _ = tiny["mistral"]  # sliding window 8: the window's reads too
    prompt = prompts_for(2)[0]
    P = len(prompt)
    real = torch.randint(3, V, (12,), generator=torch.Generator().manual_seed(4))
    junk = torch.tensor([5, 250, 17, 99, 3, 3, 42, 7, 8, 9, 10, 11, 12, 13, 14])

    def rows_of():
        if kind == "reference":
            return ReferenceRows(target.decoder, 64)
        return EngineRows(GpuEngine(target.checkpoint, 64, device="cpu", options=Options()))

    outs = []
    for dirty in (False, True):
        r = rows_of()
        r.prefill(prompt, 64)
        r.rows(real[:1], P)  # position P
        if dirty:
            r.rows(torch.cat([real[1:2], junk]), P + 1)  # P + 1 real, then junk at P + 2 .. P + 16
        got = [r.rows(real[1:4], P + 1)[0].clone()]  # rewrites P + 1 .. P + 3; reads nothing past them
        got.append(r.rows_at(real[4:9], torch.tensor([P + 4]))[0].clone())
        got.append(r.step(real[9:10], P + 9).clone())
        if dirty:
            r.rows(torch.cat([real[1:2], junk]), P + 1)
        got.append(r.rows(real[4:6], P + 4)[0].clone())  # reads P + 2, P + 3 unrewritten: junk when dirty
        outs.append(got)
    for a, b in zip(outs[0][:3], outs[1][:3]):
        assert torch.equal(a, b)
    assert not torch.equal(outs[0][3], outs[1][3])  # the junk was there to be read (the test can fail)
