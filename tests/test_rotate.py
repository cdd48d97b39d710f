"""Fair sources (trapetum/quant/rotate.py, formats/dense_export.py, `trapetum rotate`): the rotated model computes
the original's logits (tiny random Llama / Mistral / Qwen2 / Gemma-2 / Gemma-3, in memory, through the HF and GGUF
exports, in transformers), its weights no longer sit on the source's quantization grid, and the real GGUF models
rotated keep their reference perplexity (slow)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import tiny_models  # noqa: E402
from real_models import require  # noqa: E402
from test_gguf import hf_tensors, to_gguf_name, write_gguf  # noqa: E402
from trapetum.errors import UnsupportedError  # noqa: E402
from trapetum.formats.dense_export import write_dense_gguf, write_dense_hf  # noqa: E402
from trapetum.formats.detect import load_checkpoint  # noqa: E402
from trapetum.formats.gguf import load_gguf  # noqa: E402
from trapetum.models.decoder import Decoder  # noqa: E402
from trapetum.quant.rotate import RotateSpec, hadamard, random_orthogonal, rotate_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["llama2", "llama3", "mistral", "qwen2", "gemma2", "gemma3"]
TOL64 = 2e-6  # relative norm of the logit difference, float64 forward of float32 rotated weights
TOL16 = 2e-2  # the same with fp16-stored weights


def logits(ckpt, ids: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    dec = Decoder.from_checkpoint(ckpt, dtype=dtype, device="cpu").eval()
    with torch.no_grad():
        return dec(ids)[0].double()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def ids_for(vocab: int, n: int = 37, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (saved HF directory, the transformers model)."""
    out = {}
    for fam in FAMILIES:
        d = tmp_path_factory.mktemp(fam)
        out[fam] = (d, tiny_models.build(fam, d))
    return out


def test_maps_are_orthogonal():
    g = torch.Generator().manual_seed(3)
    for n in (1, 3, 53, 64, 97):
        q = random_orthogonal(n, g)
        assert float((q.T @ q - torch.eye(n, dtype=torch.float64)).abs().max()) < 1e-12
    h = hadamard(64)
    assert float((h.T @ h - torch.eye(64, dtype=torch.float64)).abs().max()) < 1e-12
    with pytest.raises(UnsupportedError, match="power-of-2"):
        hadamard(576)


@pytest.mark.parametrize("fam", FAMILIES)
def test_same_logits_in_memory(tiny, fam):
    """Every family, every option: the rotated checkpoint's logits equal the original's; weights did change."""
    d, _ = tiny[fam]
    ck = load_checkpoint(str(d))
    ids = ids_for(ck.config.vocab_size)
    ref = logits(ck, ids)
    for spec in (RotateSpec(seed=1), RotateSpec(seed=2, heads=False, mlp_perm=False)):
        rk = rotate_checkpoint(ck, spec)
        assert rel(logits(rk, ids), ref) < TOL64, (fam, spec)
    rk = rotate_checkpoint(ck, RotateSpec(seed=1))
    gemma = fam.startswith("gemma")
    # a dense rotation folds the final norm into the head and unties it; Gemma's signed permutation keeps the tie
    assert rk.config.tie_word_embeddings == (ck.config.tie_word_embeddings and gemma)
    for n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight",
              "model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight",
              "model.embed_tokens.weight"):
        assert rel(rk.tensors[n], ck.tensors[n]) > 0.1, n
    for n in rk.tensors:
        if not gemma and n.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            assert torch.all(rk.tensors[n] + ck.config.norm_offset == 1.0), n  # folded: neutral


@pytest.mark.parametrize("fam", ["gemma2", "gemma3"])
def test_signed_permutation_folds_no_norm(tiny, fam):
    """Sandwich norms (Gemma): the residual map is a signed permutation, and every norm stays, its weights
    permuted, instead of being folded into its readers (folding gave the readers' columns the pre-norms' 4-7x
    spread, which broke every quantizer of Gemma's fair source). So each reader is its source with its columns
    permuted and sign-flipped (the same multiset of magnitudes), and each norm holds its source weights."""
    d, _ = tiny[fam]
    ck = load_checkpoint(str(d))
    rk = rotate_checkpoint(ck, RotateSpec(seed=3))
    assert rk.meta["rotation"]["residual"] == "signed permutation"
    srt = lambda t: torch.sort(t.abs().flatten()).values  # noqa: E731
    for i in range(ck.config.num_layers):
        p = f"model.layers.{i}."
        for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                  "mlp.down_proj.weight", "input_layernorm.weight", "pre_feedforward_layernorm.weight",
                  "post_attention_layernorm.weight", "post_feedforward_layernorm.weight"):
            src, got = ck.tensors[p + n].to(torch.float32), rk.tensors[p + n]
            if n.endswith("layernorm.weight"):
                src, got = src + ck.config.norm_offset, got + ck.config.norm_offset
            assert torch.equal(srt(got), srt(src)), (fam, p + n)
        assert rel(rk.tensors[p + "self_attn.q_proj.weight"], ck.tensors[p + "self_attn.q_proj.weight"]) > 0.1
    assert torch.equal(srt(rk.tensors["model.norm.weight"] + ck.config.norm_offset),
                       srt(ck.tensors["model.norm.weight"].to(torch.float32) + ck.config.norm_offset))


def test_hadamard_heads(tiny):
    d, _ = tiny["llama2"]  # residual 64, heads 16: randomized Hadamard maps on both
    ck = load_checkpoint(str(d))
    ids = ids_for(ck.config.vocab_size)
    rk = rotate_checkpoint(ck, RotateSpec(seed=4, rotation="hadamard"))
    assert rel(logits(rk, ids), logits(ck, ids)) < TOL64


def _grid_error(w: np.ndarray, qt) -> float:
    """Relative error of quantizing ``w`` to GGUF type ``qt`` (0 when w already sits on that grid)."""
    back = gguf.quants.dequantize(gguf.quants.quantize(w.astype(np.float32), qt), qt).reshape(w.shape)
    return float(np.linalg.norm(back - w) / np.linalg.norm(w))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_source_grid_removed(tmp_path, arch):
    """A GGUF whose matrices are Q4_0: requantizing the source to Q4_0 is exact, the rotated weights are not."""
    Q = gguf.GGMLQuantizationType
    ref = hf_tensors(arch)
    names = {n for n, t in ref.items() if t.ndim == 2}
    qtypes = {to_gguf_name(n, arch): Q.Q4_0 for n in names}
    src = write_gguf(tmp_path / "q.gguf", arch, ref, qtypes=qtypes)
    ck = load_gguf(src)
    rk = rotate_checkpoint(ck, RotateSpec(seed=0))
    for n in sorted(names):
        a = ck.tensors[n].numpy()
        assert _grid_error(a, Q.Q4_0) < 1e-6, n
        assert _grid_error(rk.tensors[n].numpy(), Q.Q4_0) > 1e-2, n
    if not rk.config.tie_word_embeddings:
        assert _grid_error(rk.tensors["lm_head.weight"].numpy(), Q.Q4_0) > 1e-2


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "gemma3"])
def test_gguf_export_roundtrip(tmp_path, arch):
    """GGUF source -> rotated GGUF (f32 and f16) -> our loader: the original's logits; metadata copied;
    the llama permutation and Gemma's +1 norms redone; -> an HF directory with a generated config.json too."""
    ref = hf_tensors(arch)
    src = write_gguf(tmp_path / "s.gguf", arch, ref, meta_over={"general.name": "tiny-src"})
    ck = load_gguf(src)
    ids = ids_for(ck.config.vocab_size)
    want = logits(ck, ids)
    rk = rotate_checkpoint(ck, RotateSpec(seed=5))
    out = write_dense_gguf(rk, src, tmp_path / "r.gguf", "f32", extra_meta={"trapetum.rotation": "{}"})
    back = load_gguf(out)
    assert back.config == rk.config
    assert rel(logits(back, ids), want) < TOL64
    meta = {f.name: f for f in gguf.GGUFReader(str(out)).fields.values()}
    assert meta["general.name"].contents() == "tiny-src" and "trapetum.rotation" in meta
    assert meta["general.file_type"].contents() == int(gguf.LlamaFileType.ALL_F32)
    out16 = write_dense_gguf(rk, src, tmp_path / "r16.gguf", "f16")
    b16 = load_gguf(out16)
    assert {b16.tensors.formats[n] for n in b16.tensors if b16.tensors[n].ndim == 2} == {"F16"}
    assert rel(logits(b16, ids), want) < TOL16
    hf_dir = write_dense_hf(rk, tmp_path / "hf", "f32")
    assert rel(logits(load_checkpoint(str(hf_dir)), ids), want) < TOL64


@pytest.mark.parametrize("fam", ["llama3", "qwen2", "gemma3"])
def test_hf_export_in_transformers(tiny, tmp_path, fam):
    """HF source -> rotated HF directory: transformers itself gives the original model's logits."""
    import transformers as T

    d, hf = tiny[fam]
    rk = rotate_checkpoint(load_checkpoint(str(d)), RotateSpec(seed=6))
    out = write_dense_hf(rk, tmp_path / "rot", "f32")
    ids = ids_for(rk.config.vocab_size)
    rot = T.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        a, b = hf(ids).logits.double(), rot.eval()(ids).logits.double()
    assert rel(b, a) < 1e-5
    assert rel(logits(load_checkpoint(str(out)), ids), a) < 1e-5


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "trapetum.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)


def test_cli(tiny, tmp_path):
    src = write_gguf(tmp_path / "s.gguf", "qwen2", hf_tensors("qwen2"))
    r = _cli("rotate", str(src), "-o", str(tmp_path / "r.gguf"), "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "head untied" in r.stdout
    ck, rk = load_gguf(src), load_gguf(tmp_path / "r.gguf")
    ids = ids_for(ck.config.vocab_size)
    assert rel(logits(rk, ids), logits(ck, ids)) < TOL16
    d, _ = tiny["llama2"]
    bad = _cli("rotate", str(d), "-o", str(tmp_path / "x.gguf"))
    assert bad.returncode != 0 and "GGUF output needs a GGUF source" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    phi = tmp_path / "phi3"
    tiny_models.build("phi3", phi)
    bad = _cli("rotate", str(phi), "-o", str(tmp_path / "phi_out"))
    assert bad.returncode != 0 and "rotate supports dense models" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "qwen25", "gemma3"])
def test_real_model_rotated_keeps_ppl(tmp_path, name):
    """The real GGUF models, rotated to an fp16 GGUF: the same reference perplexity on the first window."""
    from trapetum.eval.perplexity import perplexity, tokenize_file

    path = require(name)
    ck = load_gguf(path)
    out = write_dense_gguf(rotate_checkpoint(ck, RotateSpec(seed=0)), path, tmp_path / "r.gguf", "f16")
    text = ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
    ids = tokenize_file(ck.tokenizer, text)
    rk = load_gguf(out)
    assert rk.tokenizer.encode("Hello, world!") == ck.tokenizer.encode("Hello, world!")
    ppl = []
    for c in (ck, rk):
        dec = Decoder.from_checkpoint(c, dtype=torch.float32, device="cpu").eval()
        ppl.append(perplexity(dec, ids, 2048, 1, progress=False))
        del dec
    assert abs(ppl[0].nll - ppl[1].nll) < 2e-3, (ppl[0].ppl, ppl[1].ppl)
