"""GPU-only engine checks (skipped without CUDA): agreement with the CPU reference for every
family, determinism of graph replays, graph == eager bitwise, fused vs unfused."""
import pytest
import torch

import trapetum
from tests.tiny_models import FAMILIES, build_cbk, build_families, randomize_additive
from trapetum.runtime.engine import GpuEngine
from trapetum.runtime.sampling import GenerationSettings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel(a, b):
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return {fam: (trapetum.load(d), trapetum.load(d, device="cuda"))
            for fam, d in build_families(tmp_path_factory).items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_matches_cpu_reference(pairs, family):
    cpu, gpu = pairs[family]
    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = cpu.logits(ids)
    eng = gpu.runner
    assert isinstance(eng, GpuEngine)
    tol = 3e-3 if family.startswith("gemma") else 2e-3
    assert rel(eng.prefill(ids), ref[-1]) < tol
    a = cpu.generate(ids, max_new_tokens=16, ignore_eos=True).token_ids
    b = gpu.generate(ids, max_new_tokens=16, ignore_eos=True).token_ids
    assert a == b


@pytest.mark.parametrize("family", ["llama3", "gemma2"])
def test_replays_bitwise_identical_and_graph_equals_eager(pairs, family):
    _, gpu = pairs[family]
    eng = gpu.runner
    ids = list(range(5, 25))
    eng.prefill(ids)
    outs = []
    for _ in range(100):
        eng.set_position(7, len(ids))
        eng.step(greedy=False)
        outs.append(eng.logits.clone())
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    eager = GpuEngine(gpu.decoder, eng.max_len, graph=False)
    eager.prefill(ids)
    eager.set_position(7, len(ids))
    eager.step(greedy=False)
    assert torch.equal(eager.logits, outs[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_unfused_agrees_with_fused(pairs, family):
    _, gpu = pairs[family]
    fused = gpu.runner
    unfused = GpuEngine(gpu.decoder, fused.max_len, fuse=False)
    ids = list(range(3, 40))
    s = GenerationSettings(max_new_tokens=16)
    assert list(fused.tokens(ids, s, 60)) == list(unfused.tokens(ids, s, 60))
    fused.prefill(ids)
    unfused.prefill(ids)
    for e in (fused, unfused):
        e.set_position(9, len(ids))
        e.step(greedy=False)
    assert rel(unfused.logits, fused.logits) < 2e-3


def test_engine_owns_packed_and_interleaved_codes(tmp_path):
    """trapetum.load(..., device="cuda") hands the codes the engine keeps in its own layouts to the engine
    (the decoder's copies are freed; Model.logits runs on the engine); keep_reference=True keeps them.
    Here: a 4-bit .cbk (interleaved gate/up copies) and 2x8 projections (packed "slices" copies)."""
    import copy
    from trapetum.errors import UnsupportedError
    out = build_cbk("llama3", tmp_path, iters=3)
    ids = list(range(5, 21))
    kept = trapetum.load(out, device="cuda", keep_reference=True)
    owned = trapetum.load(out, device="cuda")
    assert kept.decoder.released is None and owned.decoder.released is not None
    assert owned.runner.released_bytes > 0 and kept.runner.released_bytes == 0
    assert torch.equal(owned.logits(ids), kept.runner.logits_for(ids).float().cpu())
    assert rel(owned.logits(ids), kept.logits(ids)) < 2e-3
    with pytest.raises(UnsupportedError, match="keep_reference"):
        owned.decoder(torch.tensor([ids], device="cuda"))
    assert owned.generate(ids, max_new_tokens=8, ignore_eos=True).token_ids == \
        kept.generate(ids, max_new_tokens=8, ignore_eos=True).token_ids
    # 2x8 additive projections: the packed copies replace the decoder's codes
    dec = randomize_additive(trapetum.load(tmp_path / "src", device="cuda").decoder)
    dec2 = copy.deepcopy(dec)
    ref = GpuEngine(dec, 32).prefill(ids, all_logits=True)
    eng = GpuEngine(dec2, 32, own_weights=True)
    # packed (hence released) are the parts with in % 64 == 0; the down projections (in 96) stay canonical
    packed = lambda d: [m for m in d.modules() if type(m).__name__ == "AdditiveLinear" and m.in_features % 64 == 0]  # noqa: E731
    assert eng.released_bytes == sum(m.codes.numel() for m in packed(dec)) > 0
    assert all(m.codes.numel() == 0 for m in packed(dec2))
    assert all(blk.mlp.down_proj.codes.numel() > 0 for blk in dec2.model.layers)
    assert torch.equal(eng.prefill(ids, all_logits=True), ref)


@pytest.mark.parametrize("kind", ["fp16", "cb4", "aqlm-2x8"])
def test_pdl_on_and_off_give_the_same_bits(tmp_path, monkeypatch, kind):
    """Programmatic dependent launch (trapetum/kernels/cuda/pdl.cuh) only lets a GEMV's weight-only
    prologue start before the previous kernel ends: prefill and graph-decode logits are bitwise those of
    TRAPETUM_PDL=0, for the fp16 GEMV, the 4-bit codebook GEMV and the 2x8 kernel + its reduction."""
    out = build_cbk("llama3", tmp_path, iters=2)
    ids = list(range(5, 21))

    def engine():
        if kind == "aqlm-2x8":
            return GpuEngine(randomize_additive(trapetum.load(tmp_path / "src", device="cuda").decoder), 64)
        return trapetum.load(out if kind == "cb4" else tmp_path / "src", device="cuda").runner

    runs = []
    for pdl in ("1", "0"):
        monkeypatch.setenv("TRAPETUM_PDL", pdl)
        eng = engine()
        first = eng.prefill(ids).clone()
        steps = []
        for i in range(6):
            eng.set_position(len(ids) + i, len(ids) + i)
            eng.step(greedy=False)
            steps.append(eng.logits.clone())
        runs.append((first, steps))
        del eng
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_engine_keeps_no_reference_to_its_decoder(tmp_path):
    """An engine built without own_weights (bench_e2e, keep_reference) copies what it needs; once the caller
    drops the decoder, its modules and canonical codes are freed (the engine used to keep the modules it had
    copied codes from, which held a 4-bit model's codes twice on the GPU)."""
    import gc
    import weakref
    out = build_cbk("llama3", tmp_path, iters=2)
    dec = trapetum.load(out, device="cuda", keep_reference=True).decoder
    probe = weakref.ref(dec.model.layers[0].mlp.gate_proj)
    eng = GpuEngine(dec, 32)
    assert all(not p.sources for p in eng._projections())
    before = torch.cuda.memory_allocated()
    del dec
    gc.collect()
    assert probe() is None
    assert torch.cuda.memory_allocated() < before
    assert eng.prefill(list(range(5, 21))).isfinite().all()


@pytest.mark.parametrize("mode", ["split", "inline-merge"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_attention_agrees_with_unfused(pairs, family, mode, monkeypatch):
    """The default decode step (RoPE + KV append inside the split kernel, then the merge kernel; or all in one
    kernel, TRAPETUM_ATTN=inline-merge) against the three-launch path (TRAPETUM_ATTN=unfused), graph replays past a
    64-position chunk boundary: the first step's layer-0 k and v in the cache bit for bit (fused.rope_append_kv
    writes both paths' caches; later layers see the attention outputs, equal up to fp32 reduction order),
    logits within that noise, the same greedy tokens, the counters back at zero."""
    import trapetum.runtime.engine as E
    _, gpu = pairs[family]
    ids = list(range(3, 63))
    calls = []  # which attention entry point each mode's steps called (at graph capture)

    def spy(name):
        f = getattr(E, name)

        def call(*a, **kw):
            calls.append((name, kw.get("inline_merge")))
            return f(*a, **kw)
        monkeypatch.setattr(E, name, call)

    spy("decode_attention_fused")
    spy("decode_attention")
    expect = {"split": ("decode_attention_fused", False), "inline-merge": ("decode_attention_fused", True),
              "unfused": ("decode_attention", None)}
    runs = []
    for m in (mode, "unfused"):
        monkeypatch.setenv("TRAPETUM_ATTN", m)
        calls.clear()
        eng = GpuEngine(gpu.decoder, 96)
        eng.prefill(ids)
        logits, first_kv = [], None
        for t in range(len(ids), len(ids) + 6):
            eng.set_position(t % 250 + 3, t)
            eng.step(greedy=False)
            logits.append(eng.logits.clone())
            if first_kv is None:
                first_kv = (eng.k_cache[0, :, t].clone(), eng.v_cache[0, :, t].clone())
        assert set(calls) == {expect[m]} and not eng.ws.counters.any()
        runs.append((logits, first_kv, list(eng.tokens(ids, GenerationSettings(max_new_tokens=16), 90))))
    (la, kva, ta), (lb, kvb, tb) = runs
    assert torch.equal(kva[0], kvb[0]) and torch.equal(kva[1], kvb[1])
    assert all(rel(a, b) < 1e-3 for a, b in zip(la, lb))
    assert ta == tb
