"""Exact speculative decoding on the CPU: greedy speculative output equals plain greedy output, token for token,
for every drafter kind (n-gram, draft model, PARD, scripted) and adversarial drafters (always right, always wrong,
half right, random tokens, constant EOS, more tokens than asked for), on the reference decoder (three families) and
on the engine (kernels' torch fallbacks); EOS, stop strings, max tokens and the context end behave as in plain
decoding; the API, the drafter specs and the n-gram lookup. Sampling: tests/test_speculative_sampling.py.
"""
import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import trapetum
from tests.tiny_models import build, build_cbk, save_tokenizer
from trapetum.errors import ConfigError, TrapetumError
from trapetum.runtime.engine import GpuEngine
from trapetum.runtime.generate import stream_tokens
from trapetum.runtime.sampling import GenerationSettings
from trapetum.runtime.speculative import (ConstantDrafter, DraftModelDrafter, EngineRows, NgramDrafter,
                                          OverlongDrafter, PardDrafter, RandomDrafter, ReferenceRows,
                                          ScriptedDrafter, SpeculativeRunner, parse_draft)
from trapetum.runtime.speculative.ngram import lookup
from trapetum.settings import Options

FAMILIES = ["llama3", "mistral", "gemma2", "qwen2"]  # the matrix runs the first three (Mistral: sliding window 8)
KS = (1, 3, 7, 15)
MASK = 3  # a PARD mask token for the tiny models (any id works for exactness)
EOS = 2
V = 300


pytestmark = pytest.mark.usefixtures("torch_fallbacks", "one_thread")  # tests/conftest.py

def load_trios(tmp_path_factory, families) -> dict:
    """{family: (target, a different model of the family, a second copy of the target)}, with tokenizers."""
    out = {}
    for fam in families:
        a, b = tmp_path_factory.mktemp(fam), tmp_path_factory.mktemp(fam + "-other")
        build(fam, a, seed=0, tokenizer=True)
        build(fam, b, seed=1, tokenizer=True)
        out[fam] = (trapetum.load(a), trapetum.load(b), trapetum.load(a))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_trios(tmp_path_factory, FAMILIES)


def prompts_for(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    rand = torch.randint(3, V, (9,), generator=g).tolist()
    rep = [1] + [11, 12, 13, 14, 15] * 4
    return [rand, rep]


def drafters(target, other, copy_, truth: list[int], seed: int) -> dict:
    """Every drafter kind over the reference decoders; ``truth`` = prompt + plain greedy output."""
    return {
        "ngram": NgramDrafter(),
        "ngram-1": NgramDrafter(max_n=3, min_n=1),
        "draft-other": DraftModelDrafter(ReferenceRows(other.decoder)),
        "draft-self": DraftModelDrafter(ReferenceRows(copy_.decoder)),
        "pard": PardDrafter(ReferenceRows(other.decoder), MASK),
        "right": ScriptedDrafter.modeled(truth, 1.0, V),
        "wrong": ScriptedDrafter.modeled(truth, 0.0, V, seed=seed),
        "half": ScriptedDrafter.modeled(truth, 0.5, V, seed=seed),
        "random": RandomDrafter(V, seed),
        "eos": ConstantDrafter(EOS),
        "overlong": OverlongDrafter(ScriptedDrafter.modeled(truth, 1.0, V), extra=7),
    }


def spec_tokens(target_rows, drafter, prompt, s, k, adaptive=False):
    r = SpeculativeRunner(target_rows, drafter, k, adaptive=adaptive)
    return list(r.tokens(prompt, s, len(prompt) + s.max_new_tokens)), r.stats


# (family, drafters (None: all 11), Ks, Ks of the repetition-penalty round (4 drafters), prompts, new tokens, cases)
MATRIX = [pytest.param(fam, None, KS, KS, 2, 20, 2 * 11 * 4 + 2 * 4 * 4, id=fam,
                       marks=[pytest.mark.slow] if fam == "gemma2" else [])  # gemma2: 22 s on the CPU
          for fam in FAMILIES[:3]]
PENALTY_DRAFTERS = ("ngram", "draft-other", "pard", "right")


@pytest.mark.parametrize("family,names,ks,pen_ks,n_prompts,new,want", MATRIX)
def test_greedy_matrix_reference(tiny, family, names, ks, pen_ks, n_prompts, new, want):
    """11 drafters x K in (1, 3, 7, 15) x 2 prompts, greedy, and 4 drafters x 4 K x 2 prompts with a repetition
    penalty: 120 cases per family."""
    target, other, copy_ = tiny[family]
    rows = ReferenceRows(target.decoder, target.context_size)
    cases = 0
    for s, kset in ((GenerationSettings(max_new_tokens=new, ignore_eos=True), ks),
                    (GenerationSettings(max_new_tokens=new // 2 + 2, ignore_eos=True, repetition_penalty=1.3), pen_ks)):
        if not kset:
            continue
        for pi, prompt in enumerate(prompts_for(len(family))[:n_prompts]):
            plain = target.generate(prompt, s, speculative=False).token_ids
            assert len(plain) == s.max_new_tokens
            use = names or list(drafters(target, other, copy_, prompt + plain, pi))
            if s.repetition_penalty != 1.0:
                use = PENALTY_DRAFTERS
            for name in use:
                for k in kset:
                    d = drafters(target, other, copy_, prompt + plain, pi)[name]
                    got, st = spec_tokens(rows, d, prompt, s, k)
                    assert got == plain, (family, name, k, pi, s.repetition_penalty)
                    if name in ("right", "draft-self", "overlong") and s.repetition_penalty == 1.0:
                        assert st.acceptance == 1.0, (name, k, st)
                    if name == "wrong":
                        assert st.accepted == 0 and st.drafted > 0, (k, st)
                    if name == "eos":
                        assert st.accepted <= plain.count(EOS), (k, st)
                    cases += 1
    assert cases == want


def test_scripted_acceptance_and_rounds(tiny):
    target, _, _ = tiny["llama3"]
    rows = ReferenceRows(target.decoder, target.context_size)
    prompt = prompts_for(0)[0]
    s = GenerationSettings(max_new_tokens=33, ignore_eos=True)
    plain = target.generate(prompt, s, speculative=False).token_ids
    got, st = spec_tokens(rows, ScriptedDrafter.modeled(prompt + plain, 1.0, V), prompt, s, 7)
    assert got == plain and st.rounds == 4 and st.tokens_per_round == 8.0 and st.accepted_hist[7] == 4
    got, st = spec_tokens(rows, ScriptedDrafter.modeled(prompt + plain, 0.0, V), prompt, s, 3)
    assert got == plain and st.acceptance == 0.0 and st.tokens_per_round == 1.0 and st.rounds == 32
    got, st = spec_tokens(rows, ScriptedDrafter.modeled(prompt + plain, 0.6, V, seed=5), prompt, s, 7)
    assert got == plain and 0.35 < st.alpha < 0.85 and st.acceptance < st.alpha  # drafts after a rejection: redrafted


def test_adaptive_k(tiny):
    target, _, _ = tiny["qwen2"]
    rows = ReferenceRows(target.decoder, target.context_size)
    prompt = prompts_for(1)[1]
    s = GenerationSettings(max_new_tokens=60, ignore_eos=True)
    plain = target.generate(prompt, s, speculative=False).token_ids
    for alpha in (1.0, 0.0, 0.5):
        got, st = spec_tokens(rows, ScriptedDrafter.modeled(prompt + plain, alpha, V, seed=2), prompt, s, 2,
                              adaptive=True)
        assert got == plain
        if alpha == 1.0:  # k grows 2, 4, 6, ..., 15: fewer rounds than at a fixed k = 2 (20)
            assert st.rounds < 10 and max(i for i, c in enumerate(st.accepted_hist) if c) > 2
        if alpha == 0.0:
            assert st.drafted == st.rounds  # k fell to 1 and stays there


def test_engine_matrix(tmp_path, tiny):
    """The GPU engine's data path on its torch fallbacks: target and drafter engines (fp16 and a 4-bit .cbk);
    5 drafters x K in (2, 7, 15) x 2 prompts x 2 targets = 60 cases."""
    ks, n_prompts, want = (2, 7, 15), 2, 60
    target, other, _ = tiny["llama3"]
    cbk = trapetum.load(build_cbk("llama3", tmp_path, iters=3))
    cases = 0
    for tm, dm in ((target, other), (cbk, target)):
        te = GpuEngine(tm.checkpoint, 96, device="cpu", options=Options())
        de = GpuEngine(dm.checkpoint, 96, device="cpu", options=Options())
        s = GenerationSettings(max_new_tokens=18)
        for pi, prompt in enumerate(prompts_for(3)[:n_prompts]):
            plain = list(te.tokens(prompt, s, len(prompt) + 18))
            truth = prompt + plain
            for name, d in (("ngram", NgramDrafter(min_n=1)), ("draft", DraftModelDrafter(EngineRows(de))),
                            ("pard", PardDrafter(EngineRows(de), MASK)),
                            ("half", ScriptedDrafter.modeled(truth, 0.5, V, seed=pi)),
                            ("right", ScriptedDrafter.modeled(truth, 1.0, V))):
                for k in ks:
                    got, _ = spec_tokens(EngineRows(te), d, prompt, s, k)
                    assert got == plain, (tm.path, name, k, pi)
                    cases += 1
    assert cases == want


def completion(runner, m, prompt, s, tokenizer=None):
    c = None
    for ev in stream_tokens(runner, tokenizer or m.tokenizer, prompt, GenerationSettings(**vars(s)), m.context_size):
        if ev.done:
            c = ev.completion
    return (c.text, c.token_ids, c.finish_reason, c.prompt_tokens, c.completion_tokens)


def test_eos_stop_strings_and_max_tokens(tiny):
    """Drafts containing EOS or a stop string, or running past max_new_tokens: the same completion as plain."""
    target, other, _ = tiny["mistral"]
    rows = ReferenceRows(target.decoder, target.context_size)
    prompt = target.encode("the quick brown fox jumps")
    free = GenerationSettings(max_new_tokens=40, ignore_eos=True)
    plain = target.generate(prompt, free, speculative=False)
    truth = prompt + plain.token_ids
    # an EOS token mid-stream: the tokenizer copy names a token first emitted at index >= 4 as its EOS
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
            for d in (ScriptedDrafter.modeled(truth, 1.0, V), ConstantDrafter(tk.eos_ids[0]), NgramDrafter(min_n=1),
                      DraftModelDrafter(ReferenceRows(other.decoder)),
                      OverlongDrafter(ScriptedDrafter.modeled(truth, 1.0, V), 20)):
                got = completion(SpeculativeRunner(rows, d, k), target, prompt, s, tk)
                assert got == want, (s, k, d.name)
                cases += 1
    assert cases == 7 * 3 * 5
    assert want[2] == "length"
    first = completion(target.runner, target, prompt, settings[0], tk)
    assert first[2] == "stop" and len(first[1]) == idx  # the EOS case did stop at the EOS


def test_context_end_and_a_short_drafter(tiny):
    """Generation up to the last position of the KV cache (64 positions here), and a drafter whose cache is shorter
    than the target's."""
    target, other, _ = tiny["gemma2"]
    ctx = 64
    rows = ReferenceRows(target.decoder, ctx)
    prompt = prompts_for(5)[0]
    n = ctx - len(prompt)
    s = GenerationSettings(max_new_tokens=n, ignore_eos=True)
    plain = target.generate(prompt, s, speculative=False).token_ids
    assert len(plain) == n
    for d, k in ((ScriptedDrafter.modeled(prompt + plain, 1.0, V), 15), (NgramDrafter(min_n=1), 15),
                 (DraftModelDrafter(ReferenceRows(other.decoder)), 3),
                 (PardDrafter(ReferenceRows(other.decoder, max_len=40), MASK), 3)):
        got, st = spec_tokens(rows, d, prompt, s, k)
        assert got == plain, d.name
        with pytest.raises(ValueError, match="KV cache"):
            rows.rows(torch.tensor([1, 2]), ctx - 1)
    assert st.rounds >= ctx - 1 - 40  # the short PARD drafter stopped drafting at its 40 positions
    with pytest.raises(TrapetumError, match="context"):
        target.generate(prompt, GenerationSettings(max_new_tokens=target.context_size - len(prompt) + 1))


def test_api_load_with_a_drafter(tiny, tmp_path):
    target, other, _ = tiny["qwen2"]
    src = target.path
    s = dict(max_new_tokens=24, ignore_eos=True)
    prompt = "the quick brown fox"
    plain = target.generate(prompt, speculative=False, **s)
    for draft in ("ngram", "ngram:2", other.path, f"pard:{other.path}", src):
        m = trapetum.load(src, draft=draft, draft_k=5, draft_mask_token=MASK if draft.startswith("pard") else None)
        c = m.generate(prompt, **s)
        assert c.token_ids == plain.token_ids and c.text == plain.text and c.completion_tokens == 24
        assert m.speculative.stats.rounds >= 1 and m.speculative.stats.produced >= 23
        assert m.generate(prompt, speculative=False, **s).token_ids == plain.token_ids
    chat = trapetum.load(src, draft="ngram")
    msgs = [{"role": "user", "content": "hello there"}]
    assert chat.chat(msgs, max_new_tokens=16).token_ids == target.chat(msgs, max_new_tokens=16).token_ids
    m = trapetum.load(src, draft=other)  # a loaded Model as the draft model
    assert m.generate(prompt, **s).token_ids == plain.token_ids


def test_api_errors(tiny, tmp_path):
    target, other, _ = tiny["qwen2"]
    with pytest.raises(TrapetumError, match="1..15"):
        trapetum.load(target.path, draft="ngram", draft_k=16)
    with pytest.raises(TrapetumError, match="1..15"):
        trapetum.load(target.path, draft="ngram", draft_k=0)
    with pytest.raises(ConfigError, match="pard_token"):
        trapetum.load(target.path, draft=f"pard:{other.path}")
    with pytest.raises(ConfigError, match="ngram:N"):
        trapetum.load(target.path, draft="ngram:x")
    with pytest.raises(TrapetumError, match="separate model"):
        target._attach_draft(target, 3, False, None)
    # a drafter with another tokenizer is refused
    d = tmp_path / "othertok"
    build("qwen2", d, seed=3)
    save_tokenizer(d, vocab=260)
    with pytest.raises(ConfigError, match="tokenizer"):
        trapetum.load(target.path, draft=str(d))
    # PARD's mask token from config.json
    cfg = json.loads((Path(other.path) / "config.json").read_text())
    p = tmp_path / "pard"
    build("qwen2", p, seed=1, tokenizer=True)
    (p / "config.json").write_text(json.dumps(dict(cfg, pard_token=7)))
    m = trapetum.load(target.path, draft=f"pard:{p}")
    assert m.speculative.drafter.mask_token == 7
    (p / "config.json").write_text(json.dumps(dict(cfg, pard_token=10 ** 6)))
    with pytest.raises(ConfigError, match="mask token"):
        trapetum.load(target.path, draft=f"pard:{p}")


def test_parse_draft():
    assert parse_draft("ngram") == ("ngram", None) and parse_draft("ngram:3") == ("ngram", "3")
    assert parse_draft("pard:/m/x.cbk") == ("pard", "/m/x.cbk") and parse_draft("/m/d.gguf") == ("model", "/m/d.gguf")
    for bad in ("", "  ", "pard:", "ngram:0", "ngram:99"):
        with pytest.raises(ConfigError):
            parse_draft(bad)


def test_ngram_lookup():
    a = np.array
    # longest suffix wins over a more recent shorter match; the most recent of the longest is used
    seq = a([5, 6, 7, 1, 2, 9, 9, 6, 7, 3, 4, 5, 6, 7, 8, 5, 6, 7])
    assert lookup(seq, 3, max_n=3, min_n=1).tolist() == [8, 5, 6]  # 5 6 7 at 11..13 (more recent than 0..2)
    assert lookup(seq, 3, max_n=2, min_n=2).tolist() == [8, 5, 6]  # 6 7 most recently at 12..13
    assert lookup(a([1, 2, 3, 4]), 3, max_n=3, min_n=1).size == 0  # no earlier occurrence of 4
    assert lookup(a([1, 2, 3, 9, 3]), 4, max_n=3, min_n=2).size == 0  # only a 1-gram matches
    assert lookup(a([1, 2, 3, 9, 3]), 4, max_n=3, min_n=1).tolist() == [9, 3]  # continuation cut at the end
    assert lookup(a([7, 7, 7, 7]), 5, max_n=3, min_n=1).tolist() == [7]  # most recent 3-gram ends at 2
    assert lookup(a([4, 2]), 0).size == 0


def test_cli_generate_with_a_drafter_prints_the_plain_output(tmp_path, capsys):
    """`trapetum generate MODEL PROMPT --draft ngram` prints what plain greedy generation prints; --stats adds the
    speculative line (acceptance, tokens per round)."""
    from trapetum.cli import main
    build("llama3", tmp_path / "m", tokenizer=True)
    argv = ["generate", str(tmp_path / "m"), "the quick brown fox", "--max-new-tokens", "12", "--ignore-eos"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main(argv + ["--draft", "ngram", "--draft-k", "3", "--stats"]) == 0
    out = capsys.readouterr()
    assert out.out == plain
    assert "[speculative" in out.err


def test_server_serves_a_speculative_model_and_its_plain_view(tmp_path):
    """A model loaded with a drafter is served as NAME and as NAME:plain (the compare view's pair): the plain view's
    streams decode without the drafter, with the same greedy tokens."""
    from trapetum.serve.worker import PlainView
    build("llama3", tmp_path / "m", tokenizer=True)
    m = trapetum.load(tmp_path / "m", draft="ngram", draft_k=3)
    plain = PlainView(m)
    ids = list(range(5, 20))
    a = [ev.token_id for ev in m.stream(ids, max_new_tokens=10, ignore_eos=True) if ev.token_id is not None]
    b = [ev.token_id for ev in plain.stream(ids, max_new_tokens=10, ignore_eos=True) if ev.token_id is not None]
    assert a == b and plain.name == m.name and m.speculative is not None
