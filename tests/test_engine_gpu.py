"""GPU-only engine checks (skipped without CUDA): agreement with the CPU reference for every family, determinism of
graph replays, graph == eager bitwise, fused vs unfused, PDL on / off, the engine built from the checkpoint with its
weights held once, and loading memory."""
import pytest
import torch

import trapetum
from tests.tiny_models import FAMILIES, additive_checkpoint, build_cbk, build_families
from trapetum.formats.detect import load_checkpoint
from trapetum.runtime.engine import GpuEngine
from trapetum.runtime.sampling import GenerationSettings
from trapetum.settings import Options

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.gpu]


def rel(a, b):
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return {fam: (trapetum.load(d), trapetum.load(d, device="cuda", options=Options()))
            for fam, d in build_families(tmp_path_factory).items()}


def random_2x8(tmp_path):
    return additive_checkpoint("llama3", tmp_path / "src")


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


def assert_replays_bitwise_and_graph_equals_eager(gpu, ids: list[int]) -> GpuEngine:
    """100 graph replays of one decode step after ``ids`` bitwise identical, and equal to the step of an eager
    engine (graphs off) over the same checkpoint, which is returned (also for tests/test_moe_engine_gpu.py)."""
    eng = gpu.runner
    eng.prefill(ids)
    outs = []
    for _ in range(100):
        eng.set_position(7, len(ids))
        eng.step(greedy=False)
        outs.append(eng.logits.clone())
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    eager = GpuEngine(gpu.checkpoint, eng.max_len, options=Options(graph=False))
    eager.prefill(ids)
    eager.set_position(7, len(ids))
    eager.step(greedy=False)
    assert torch.equal(eager.logits, outs[0])
    return eager


@pytest.mark.parametrize("family", ["llama3", "gemma2"])
def test_replays_bitwise_identical_and_graph_equals_eager(pairs, family):
    _, gpu = pairs[family]
    eng, ids = gpu.runner, list(range(5, 25))
    eager = assert_replays_bitwise_and_graph_equals_eager(gpu, ids)
    # verify graphs too: captured once, replayed, equal to eager
    rows = [eng.verify(list(range(9, 17)), len(ids)).clone() for _ in range(3)]
    assert all(torch.equal(rows[0], r) for r in rows[1:])
    assert torch.equal(eager.verify(list(range(9, 17)), len(ids)), rows[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_unfused_agrees_with_fused(pairs, family):
    _, gpu = pairs[family]
    fused = gpu.runner
    unfused = GpuEngine(gpu.checkpoint, fused.max_len, options=Options(fuse=False))
    ids = list(range(3, 40))
    s = GenerationSettings(max_new_tokens=16)
    # fusion changes roundings (fp32 residual add inside the GEMV vs an fp16 add): the same greedy start, logits
    # within tolerance below; a near-tie may flip later tokens
    assert list(fused.tokens(ids, s, 60))[:8] == list(unfused.tokens(ids, s, 60))[:8]
    fused.prefill(ids)
    unfused.prefill(ids)
    for e in (fused, unfused):
        e.set_position(9, len(ids))
        e.step(greedy=False)
    assert rel(unfused.logits, fused.logits) < 2e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_attention_equals_unfused_attention(pairs, family):
    """RoPE + KV append inside the split kernel against the separate launches (Options.attention): the same bits
    in the cache and the logits, graph replays past a 64-position chunk boundary."""
    _, gpu = pairs[family]
    ids = list(range(3, 63))
    runs = []
    for mode in ("fused", "unfused"):
        eng = GpuEngine(gpu.checkpoint, 96, options=Options(attention=mode))
        eng.prefill(ids)
        logits = []
        for t in range(len(ids), len(ids) + 6):
            eng.set_position(t % 250 + 3, t)
            eng.step(greedy=False)
            logits.append(eng.logits.clone())
        runs.append((logits, eng.k_cache.clone(), eng.v_cache.clone()))
    (la, ka, va), (lb, kb, vb) = runs
    assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert all(torch.equal(a, b) for a, b in zip(la, lb))


@pytest.mark.parametrize("kind", ["fp16", "cb4", "aqlm-2x8"])
def test_pdl_on_and_off_give_the_same_bits(tmp_path, kind):
    """Programmatic dependent launch only lets a GEMV's weight-only prologue start before the previous kernel ends:
    prefill and graph-decode logits are bitwise those with PDL off, for the fp16 GEMV, the 4-bit codebook GEMV and
    the 2x8 kernel + its reduction."""
    out = build_cbk("llama3", tmp_path, iters=2)
    ck = {"fp16": lambda: load_checkpoint(tmp_path / "src"), "cb4": lambda: load_checkpoint(out),
          "aqlm-2x8": lambda: random_2x8(tmp_path / "a")}[kind]()
    ids = list(range(5, 21))
    runs = []
    for pdl in ("all", "off"):
        eng = GpuEngine(ck, 64, options=Options().replace(kernels={"pdl": pdl}))
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


def test_engine_holds_its_weights_once(tmp_path):
    """trapetum.load(..., device="cuda") builds the engine from the checkpoint: no reference decoder on the GPU,
    the engine's weights in their kernel layouts only; the reference decoder is built on demand (Model.decoder)."""
    out = build_cbk("llama3", tmp_path, iters=2)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    m = trapetum.load(out, device="cuda")
    eng = m.runner
    held = torch.cuda.memory_allocated() - before
    own = eng.weight_bytes() + eng.kv.nbytes()
    assert m._decoder is None
    assert held <= 1.15 * own + (64 << 20), (held, own)  # + workspaces and the rope tables
    ids = list(range(5, 21))
    assert rel(m.logits(ids), trapetum.load(out).logits(ids)) < 2e-3


def test_2x8_engine_matches_its_reference(tmp_path):
    ck = random_2x8(tmp_path)
    eng = GpuEngine(ck, 64)
    assert any(getattr(L.attention.qkv, "packed", None) is not None for L in eng.model.layers)
    from trapetum.models.decoder import Decoder
    ref = Decoder.from_checkpoint(ck, dtype=torch.float32, device="cuda")
    ids = list(range(5, 21))
    want = ref(torch.tensor([ids], device="cuda"))[0]
    assert rel(eng.prefill(ids, all_logits=True), want) < 3e-3
    eng.prefill(ids[:-1])
    eng.set_position(ids[-1], len(ids) - 1)
    eng.step(greedy=False)
    assert rel(eng.logits, want[-1]) < 3e-3
