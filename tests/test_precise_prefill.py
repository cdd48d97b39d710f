"""The engine's opt-in precise prefill (runtime/precise.py) against the CPU fp32 reference.

On the CPU the engine runs its kernels' torch fallbacks (as tests/test_engine.py does); one test runs the
default and precise prefills with the real Triton kernels under TRITON_INTERPRET=1 in a subprocess. The
GPU tests at the end (skipped here) check the same through trapetum.load(..., device="cuda").
"""
import os
import subprocess
import sys

import pytest
import torch

import trapetum
from tests.kernels_conftest import requires_cuda
from tests.tiny_models import FAMILIES, build, build_cbk, build_families
from trapetum.errors import ConfigError, UnsupportedError
from trapetum.formats.detect import load_checkpoint
from trapetum.runtime import precise as P
from trapetum.runtime.engine import GpuEngine
from trapetum.runtime.sampling import GenerationSettings
from trapetum.schemes.base import residual16
from trapetum.settings import Options

ENV = "TRAPETUM_PREFILL"


def engine(ckpt, max_len, precise=False, **opts):
    """The engine on the CPU (torch fallbacks), default or precise prefill."""
    return GpuEngine(ckpt, max_len, device="cpu", options=Options(prefill="precise" if precise else "default", **opts))

# Tiny random models: the default prefill is 5e-4..2e-3 from the reference (fp16 weights and
# activations), the precise one ~1e-6 (fp32 rounding of the reference itself).
PRECISE_TOL = 1e-5
DEFAULT_FLOOR = 1e-4  # the default prefill is never this close (fp16 rounding of the logits alone: ~3e-4)
DEFAULT_TOL = {"gemma2": 3e-3, "gemma3": 3e-3}


def rel(a, b):
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


@pytest.fixture(autouse=True)
def torch_fallbacks(monkeypatch, request):
    """Kernels' torch fallbacks on the CPU; no TRAPETUM_PREFILL from the caller's environment."""
    monkeypatch.delenv(ENV, raising=False)
    if not torch.cuda.is_available() and "interpreter" not in request.node.name:
        monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {fam: trapetum.load(d) for fam, d in build_families(tmp_path_factory).items()}


def ids_for(n, seed=0):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ----------------------------------------------------------------------------- arithmetic
def test_split16_represents_fp32_rows_across_magnitudes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 257, generator=g) * torch.tensor([1e-30, 1e-7, 1e-3, 1.0, 3e4, 1e30])[:, None]
    x[2, :5] *= 1e-9  # entries far below their row's scale
    hilo, e = P.split16(x)
    back = torch.ldexp(hilo[:6].double() + hilo[6:].double() / P.LO_SCALE, e)
    err = ((back - x.double()).abs() / x.double().abs().amax(-1, keepdim=True)).max().item()
    assert hilo.dtype == torch.float16 and torch.isfinite(hilo).all()
    assert err < 2 ** -22, err


def test_linear_is_fp32_accurate_where_fp16_is_not():
    """fp32 x with a wide range (fp16 would overflow / flush) times fp16 weights, vs float64."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=g) * torch.tensor([1e-6, 1e-2, 1.0, 1e3, 1e5])[:, None]
    w = (torch.randn(40, 96, generator=g) * 0.1).half()
    b = torch.randn(40, generator=g).half()
    exact = x.double() @ w.double().T + b.double()
    y = P.precise_linear(x, w, b)
    assert y.dtype == torch.float32
    for r in range(5):  # row by row: each row has its own scale
        assert rel(y[r], exact[r]) < 1e-6
    assert not torch.isfinite(torch.nn.functional.linear(x[4:].half(), w, b)).all()  # fp16 input overflows


def test_residual_restores_non_fp16_weights():
    g = torch.Generator().manual_seed(2)
    w32 = torch.randn(24, 64, generator=g) * 0.05
    w16 = w32.half()
    assert residual16(w16.float(), w16) is None and residual16(w16, w16) is None
    lo = residual16(w32, w16)
    assert lo.dtype == torch.float16
    back = w16.double() + lo.double() / P.LO_SCALE
    assert rel(back, w32.double()) < 1e-7 < rel(w16, w32)


# ----------------------------------------------------------------------------- engine, every family
@pytest.mark.parametrize("family", FAMILIES)
def test_precise_prefill_matches_reference(tiny, family):
    """Every prompt position: precise ~1e-6 from the fp32 reference; the default prefill is > 1e-4 away
    (and within its own tolerance)."""
    m = tiny[family]
    ids = ids_for(20)
    ref = m.logits(ids)
    fast = engine(m.checkpoint, 48)
    prec = engine(m.checkpoint, 48, precise=True)
    d = rel(fast.prefill(ids, all_logits=True), ref)
    p = rel(prec.prefill(ids, all_logits=True), ref)
    assert p < PRECISE_TOL, (family, p, d)
    assert DEFAULT_FLOOR < d < DEFAULT_TOL.get(family, 2e-3), (family, p, d)
    assert rel(prec.prefill(ids), ref[-1]) < PRECISE_TOL  # last position only


@pytest.mark.parametrize("family", ["llama3", "gemma2"])
def test_precise_prefill_then_decode(tiny, family):
    """The precise prefill fills the fp16 KV cache for the decode steps: steps and greedy tokens as usual."""
    m = tiny[family]
    ids = ids_for(20, seed=4)  # (seed 3 has a 1e-4 top-2 tie in gemma2's decode: fp16 steps may flip it)
    ref = m.logits(ids)
    eng = engine(m.checkpoint, 48, precise=True)
    assert rel(eng.prefill(ids[:-4]), ref[-5]) < PRECISE_TOL
    tol = DEFAULT_TOL.get(family, 2e-3)
    for i, t in enumerate(ids[-4:]):
        eng.set_position(t, 16 + i)
        eng.step(greedy=False)
        assert rel(eng.logits, ref[16 + i]) < tol
    toks = list(eng.tokens(ids, GenerationSettings(max_new_tokens=12), 32))
    assert toks == m.generate(ids, max_new_tokens=12, ignore_eos=True).token_ids


def test_precise_prefill_unfused(tiny):
    m = tiny["qwen2"]  # qkv biases: their residuals too
    ids = ids_for(16, seed=4)
    ref = m.logits(ids)
    eng = engine(m.checkpoint, 32, precise=True, fuse=False)
    assert rel(eng.prefill(ids, all_logits=True), ref) < PRECISE_TOL


def test_precise_prefill_fp16_exact_weights(tmp_path):
    """A checkpoint whose weights are fp16 numbers needs no residuals (the .cbk / fp16-source case)."""
    build("llama3", tmp_path)
    ck = load_checkpoint(tmp_path)
    ck.tensors = {n: t.half().float() for n, t in ck.tensors.items()}
    m = trapetum.load(tmp_path)
    m.checkpoint = ck
    m._decoder = None
    ids = ids_for(18, seed=5)
    ref = m.logits(ids)
    eng = engine(ck, 32, precise=True)
    projs = [eng.model.head] + [p for L in eng.model.layers for p in (L.attention.qkv, L.attention.o, L.mlp.down)]
    assert all(p.lo is None and p.bias_lo is None for p in projs) and eng.model.embed_lo is None
    p = rel(eng.prefill(ids, all_logits=True), ref)
    d = rel(engine(ck, 32).prefill(ids, all_logits=True), ref)
    assert p < PRECISE_TOL < DEFAULT_FLOOR < d


@pytest.mark.parametrize("family", ["llama3", "gemma3"])
def test_precise_prefill_quantized_cbk(tmp_path, family):
    """A .cbk (4-bit projections, 8-bit tied head and embedding): codebook projections, no residuals."""
    out = build_cbk(family, tmp_path)
    m = trapetum.load(out)
    ids = ids_for(20, seed=6)
    ref = m.logits(ids)
    eng = engine(m.checkpoint, 40, precise=True)
    assert eng.model.head.kind == "codebook" and eng.model.head.lo is None and eng.model.embed_lo is None
    p = rel(eng.prefill(ids, all_logits=True), ref)
    d = rel(engine(m.checkpoint, 40).prefill(ids, all_logits=True), ref)
    assert p < PRECISE_TOL, (p, d)
    assert DEFAULT_FLOOR < d < DEFAULT_TOL.get(family, 2e-3), (p, d)


def test_precise_prefill_scores_windows_like_the_reference(tiny):
    from trapetum.eval.perplexity import window_nll
    m = tiny["mistral"]  # sliding window 8 < the window
    w = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(7))
    ref, n = window_nll(m.decoder, w)
    pre, n1 = window_nll(engine(m.checkpoint, 64, precise=True), w)
    assert n == n1 == 39 and abs(pre - ref) / n < 1e-6


def test_precise_prefill_refuses_additive_projections(tmp_path):
    from tests.aqlm_helpers import make_aqlm_dir
    m = trapetum.load(make_aqlm_dir(tmp_path, random_codes=True))
    eng = engine(m.checkpoint, 16)  # the default engine runs them
    assert eng.model.layers[0].attention.qkv.kind == "additive"
    assert torch.isfinite(eng.prefill([5, 6, 7])).all()
    with pytest.raises(UnsupportedError, match="additive"):
        engine(m.checkpoint, 16, precise=True)


def test_precise_prefill_under_triton_interpreter(tmp_path):
    """The default prefill with the engine's real Triton kernels (interpreted) vs the precise one."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():  # a CPU-interpreter test (the GPU machine's Triton 3.6 interpreter
        pytest.skip("CPU interpreter test")  # cannot index range() bounds given as arrays)
    code = f"""
import torch, trapetum
from tests.tiny_models import build
from trapetum.runtime.engine import GpuEngine
from trapetum.settings import Options
build("llama3", {str(tmp_path)!r})
m = trapetum.load({str(tmp_path)!r})
ids = list(range(5, 19))
ref = m.logits(ids)
rel = lambda a, b: float((a - b).norm() / b.norm())
d = rel(GpuEngine(m.checkpoint, 16, device="cpu").prefill(ids, all_logits=True), ref)
eng = GpuEngine(m.checkpoint, 16, device="cpu", options=Options(prefill="precise"))
p = rel(eng.prefill(ids[:-1], all_logits=True), ref[:-1])
assert p < {PRECISE_TOL} and {DEFAULT_FLOOR} < d < 2e-3, (p, d)
eng.set_position(ids[-1], 13)
eng.step(greedy=False)  # the Triton decode step on the cache the precise prefill wrote
assert rel(eng.logits, ref[-1]) < 2e-3
print("ok", p, d)
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop(ENV, None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


# ----------------------------------------------------------------------------- the switch
def test_env_switch(tiny, monkeypatch):
    """TRAPETUM_PREFILL is read by settings at the edge (trapetum.load); the argument wins over it."""
    path = tiny["llama2"].path
    for v, mode in (("precise", "precise"), ("PRECISE", "precise"), ("default", "default"), ("", "default"),
                    ("exact", "exact")):
        monkeypatch.setenv(ENV, v)
        assert Options.from_env().prefill == mode, v
    monkeypatch.setenv(ENV, "precise")
    assert trapetum.load(path, precise_prefill=False).options.prefill == "default"
    monkeypatch.setenv(ENV, "default")
    assert trapetum.load(path, precise_prefill=True).options.prefill == "precise"


@pytest.mark.parametrize("bad", ["1", "fp32", "precise,fast", "on"])
def test_env_switch_rejects_bad_values(tiny, monkeypatch, bad):
    monkeypatch.setenv(ENV, bad)
    with pytest.raises(ConfigError, match=rf"TRAPETUM_PREFILL: expected one of default, precise, exact, got {bad!r}"):
        Options.from_env()
    with pytest.raises(ConfigError, match="TRAPETUM_PREFILL"):
        trapetum.load(tiny["llama2"].path)


def test_cli_flags(tmp_path, capsys):
    from trapetum.cli import build_parser, main
    build("llama2", tmp_path / "m", tokenizer=True)
    p = build_parser()
    assert p.parse_args(["ppl", "x", "--text", "t", "--precise-prefill"]).precise_prefill is True
    assert p.parse_args(["ppl", "x", "--text", "t"]).precise_prefill is None  # None: TRAPETUM_PREFILL decides
    assert p.parse_args(["generate", "x", "hi", "--precise-prefill"]).precise_prefill is True
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    assert main(["ppl", str(tmp_path / "m"), "--text", str(text), "--precise-prefill", "--decode"]) == 1
    assert "--precise-prefill" in capsys.readouterr().err
    # on the CPU the reference path is fp32 already: the flag is accepted and changes nothing
    assert main(["ppl", str(tmp_path / "m"), "--text", str(text), "--ctx", "32", "--windows", "1", "--quiet",
                 "--precise-prefill"]) == 0
    a = capsys.readouterr().out
    assert main(["ppl", str(tmp_path / "m"), "--text", str(text), "--ctx", "32", "--windows", "1", "--quiet"]) == 0
    assert capsys.readouterr().out == a
    assert main(["generate", str(tmp_path / "m"), "the", "--max-new-tokens", "4", "--precise-prefill"]) == 0


def test_api_on_cpu_keeps_the_reference_path(tiny):
    m = trapetum.load(tiny["llama2"].path, precise_prefill=True)
    assert m.precise_prefill is False and m.dtype == torch.float32 and not isinstance(m.runner, GpuEngine)


# ----------------------------------------------------------------------------- on the GPU
@pytest.fixture(scope="module")
def gpu_pairs(tmp_path_factory):
    return {fam: (trapetum.load(d), d) for fam, d in build_families(tmp_path_factory).items()}


@requires_cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_precise_prefill_matches_reference(gpu_pairs, family):
    cpu, d = gpu_pairs[family]
    ids = ids_for(24)
    ref = cpu.logits(ids)
    fast = trapetum.load(d, device="cuda")
    prec = trapetum.load(d, device="cuda", precise_prefill=True)
    assert prec.precise_prefill and prec.runner.options.prefill == "precise" and fast.runner.options.prefill == "default"
    dft = rel(fast.runner.prefill(ids, all_logits=True), ref)
    p = rel(prec.runner.prefill(ids, all_logits=True), ref)
    assert p < 2e-5 and p < dft / 10, (family, p, dft)
    assert DEFAULT_FLOOR < dft < DEFAULT_TOL.get(family, 2e-3), (family, p, dft)
    a = cpu.generate(ids, max_new_tokens=16, ignore_eos=True).token_ids
    assert prec.generate(ids, max_new_tokens=16, ignore_eos=True).token_ids == a


@requires_cuda
def test_gpu_precise_prefill_cbk(tmp_path):
    out = build_cbk("llama3", tmp_path)
    cpu = trapetum.load(out)
    ids = ids_for(24, seed=2)
    ref = cpu.logits(ids)
    p = rel(trapetum.load(out, device="cuda", precise_prefill=True).runner.prefill(ids, all_logits=True), ref)
    d = rel(trapetum.load(out, device="cuda").runner.prefill(ids, all_logits=True), ref)
    assert p < 2e-5 and DEFAULT_FLOOR < d, (p, d)


@requires_cuda
def test_gpu_env_switch_and_fp32_output_gemm(gpu_pairs, monkeypatch):
    _, d = gpu_pairs["llama3"]
    monkeypatch.setenv(ENV, "precise")
    m = trapetum.load(d, device="cuda")
    assert m.precise_prefill and m.runner.options.prefill == "precise"
    monkeypatch.setenv(ENV, "bogus")
    with pytest.raises(ConfigError, match="TRAPETUM_PREFILL"):
        trapetum.load(d, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(64, 512, device="cuda", generator=g).half()
    b = torch.randn(512, 96, device="cuda", generator=g).half()
    y = P.mm32(a, b)
    assert y.dtype == torch.float32 and rel(y, a.double() @ b.double()) < 1e-6
    torch.backends.cuda.matmul.allow_tf32 = True  # a precise prefill switches TF32 off for its duration
    try:
        ids = ids_for(20)
        cpu = gpu_pairs["llama3"][0]
        assert rel(m.runner.prefill(ids, all_logits=True), cpu.logits(ids)) < 2e-5
        assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
