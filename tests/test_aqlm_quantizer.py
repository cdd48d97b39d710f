"""Our additive quantizer: beats a 2-bit scalar codebook; whole-model driver is resumable (same file);
a tied model stores one shared 8-bit table for embedding and head (as the scalar path), an untied one
an fp16 embedding and an 8-bit head; its .cbk, exported as an AQLM directory, runs in transformers +
aqlm with Trapetum's logits."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

import trapetum
from tiny_models import build
from trapetum.quant.convert_aqlm import export_aqlm
from trapetum.formats.cbk import open_cbk
from trapetum.models.decoder import Decoder
from trapetum.quant.additive import dequantize_aqlm, quantize_additive
from trapetum.quant.additive_driver import AdditiveRecipe, quantize_additive_to_cbk
from trapetum.quant.kmeans import kmeans_rows, weighted_error
from trapetum.schemes import registry

FAST = dict(beam=2, iters=0, beam_steps=1, kmeans_iters=2, calib_seqs=2, calib_sample_len=16)  # CI-sized


def _structured(out_f, in_f, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = (torch.randn(out_f, 16, generator=g) @ torch.randn(16, in_f, generator=g)) * 0.02
    W += torch.randn(out_f, in_f, generator=g) * 0.01 * torch.rand(in_f, generator=g) ** 2
    imp = torch.rand(in_f, generator=g) ** 4 + 1e-3
    return W, imp


def test_beats_scalar_2bit_and_improves():
    W, imp = _structured(64, 256)
    r = quantize_additive(W, imp, num_codebooks=2, nbits=8, beam=4, iters=2)
    Wq = dequantize_aqlm(r.codes, r.codebooks, r.scales)
    e_add = weighted_error(W, Wq, imp)
    k = kmeans_rows(W, 4, imp)
    e_sc = weighted_error(W, torch.gather(k.codebook.float(), 1, k.codes.long()), imp)
    assert e_add < 0.8 * e_sc, (e_add, e_sc)
    assert all(b <= a + 1e-6 for a, b in zip(r.history[:-2], r.history[1:-1]))  # LS + beam never worse
    assert r.codes.dtype == torch.int8 and r.codebooks.dtype == torch.float16 and r.scales.shape == (64, 1, 1, 1)
    # the final history entry is the error of exactly what is stored
    assert abs(r.history[-1] ** 0.5 - e_add) < 1e-4


@pytest.mark.parametrize("n,k,m,beam", [(3000, 256, 2, 4), (1500, 64, 3, 2), (1000, 4, 2, 8)])
def test_beam_search_does_not_depend_on_the_chunk(n, k, m, beam):
    """The block size only batches independent searches (the GPU default, 65536 vectors, differs from the
    CPU's 8192): any chunking gives the same codes, never worse than the start."""
    from trapetum.quant.additive import _beam_search
    g = torch.Generator().manual_seed(n + k)
    v, h = torch.randn(n, 8, generator=g), torch.rand(n, 8, generator=g) + 0.1
    C = torch.randn(m, k, 8, generator=g) * 0.7
    idx = torch.randint(0, k, (n, m), generator=g)
    got = [_beam_search(v, h, C, idx, beam, 2, chunk) for chunk in (n, 700, 256)]
    assert all(torch.equal(got[0], x) for x in got[1:])
    err = lambda i: ((v - sum(C[q][i[:, q]] for q in range(m))) ** 2 * h).sum(1)
    assert (err(got[0]) <= err(idx) + 1e-5).all()
    assert err(got[0]).sum() < 0.9 * err(idx).sum()  # and it searches: random starts improve


def test_1x16_codes_and_nearest():
    W, imp = _structured(64, 64, seed=1)
    r = quantize_additive(W, imp, num_codebooks=1, nbits=16, iters=0, kmeans_iters=1)
    assert r.codes.dtype == torch.int16 and r.codebooks.shape == (1, 65536, 1, 8)
    assert weighted_error(W, dequantize_aqlm(r.codes, r.codebooks, r.scales), imp) < 0.05  # 512 vectors, 64k entries


def _logits(cbk_path, ids):
    dec = Decoder.from_checkpoint(open_cbk(cbk_path).to_checkpoint(), dtype=torch.float32, device="cpu").eval()
    with torch.no_grad():
        return dec, dec(ids)[0]


def test_resume_gives_same_file(tmp_path):
    src = tmp_path / "hf"
    build("llama2", src, tokenizer=True)
    rec = AdditiveRecipe(scheme="aqlm-2x8", **FAST)
    prov = {"created": "fixed"}
    a, _ = quantize_additive_to_cbk(str(src), tmp_path / "a.cbk", rec, progress=False, provenance=prov,
                                    log=lambda s: None)
    with pytest.raises(KeyboardInterrupt):
        quantize_additive_to_cbk(str(src), tmp_path / "b.cbk", rec, progress=False, stop_after=1,
                                 log=lambda s: None)
    parts = sorted(p.name for p in (tmp_path / "b.cbk.parts").iterdir())
    assert parts == ["calibration.safetensors", "layer_0000.safetensors"]
    logs = []
    b, _ = quantize_additive_to_cbk(str(src), tmp_path / "b.cbk", rec, progress=False, provenance=prov,
                                    log=logs.append)
    assert any("reusing" in s for s in logs)
    assert a.read_bytes() == b.read_bytes()
    assert not (tmp_path / "b.cbk.parts").exists()
    f = open_cbk(b)
    assert f.layers["model.layers.0.mlp.up_proj.weight"].scheme == "aqlm"
    assert f.layers["lm_head.weight"].params == {"bits": 8, "codebook": "shared", "group_rows": 512}  # the scalar head


@pytest.mark.parametrize("scheme", ["aqlm-2x8", pytest.param("aqlm-1x16", marks=pytest.mark.slow)])
def test_transformers_aqlm_agrees(tmp_path, scheme):
    # aqlm's CPU 2x8 kernel (numba) accumulates into one output vector from a parallel loop over input
    # groups: a data race that corrupts sums when several threads run. One thread makes it exact.
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    pytest.importorskip("aqlm")
    if scheme == "aqlm-2x8":
        pytest.importorskip("numba")  # aqlm's CPU kernel for 2x8
    from transformers import AutoModelForCausalLM

    src = tmp_path / "hf"
    build("llama2", src, tokenizer=True)
    cbk, _ = quantize_additive_to_cbk(str(src), tmp_path / "q.cbk", AdditiveRecipe(scheme=scheme, **FAST),
                                      progress=False, log=lambda s: None)
    out = export_aqlm(cbk, tmp_path / "aqlm", log=lambda s: None)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "aqlm"
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf.model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    ids = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64, 12, 5]])
    dec, ours = _logits(cbk, ids)
    with torch.no_grad():
        ref = hf(ids).logits[0].float()
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert rel < 2e-3, rel
    with torch.no_grad():
        g = hf.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
        seq = ids
        for _ in range(16):
            nxt = dec(seq)[0, -1].argmax().view(1, 1)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(seq[0, ids.shape[1]:], g), (seq, g)


def _hf_logits_from_dequantized(src, cbk_path, ids):
    """Reference logits: the source's transformers model with every weight replaced by the file's
    (dequantized) weights; a tied model's head follows its embedding inside transformers."""
    from transformers import AutoModelForCausalLM

    f = open_cbk(cbk_path)
    sd = {n: f.tensor(n).float() for n in f.dense}
    for name in f.layers:
        rec = f.record(name)
        sd[name] = registry.dequantize(rec, torch.float32, name)
        if rec.bias is not None:
            sd[name[: -len(".weight")] + ".bias"] = rec.bias.float()
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    assert not missing or hf.config.tie_word_embeddings
    with torch.no_grad():
        return hf(ids).logits[0].float()


def _head_tensors(cbk_path):
    """{stored tensor name: (dtype, shape)} of the embedding and LM head."""
    f = open_cbk(cbk_path)
    return {n: (t.dtype, t.shape) for n, t in f.tensors_table.items() if "embed_tokens" in n or "lm_head" in n}


def test_tied_model_shares_one_8bit_table(tmp_path):
    src = tmp_path / "hf"
    build("qwen2", src, tokenizer=True)  # tie_word_embeddings, qkv biases; vocab 300, hidden 64
    rec = AdditiveRecipe(scheme="aqlm-2x8", **FAST)
    kw = dict(progress=False, provenance={"created": "fixed"}, log=lambda s: None)
    shared, qm = quantize_additive_to_cbk(str(src), tmp_path / "shared.cbk", rec, **kw)
    # the layout before: fp16 embedding plus the head's own 8-bit table (still there with embed_bits=None)
    apart, _ = quantize_additive_to_cbk(str(src), tmp_path / "apart.cbk", replace(rec, embed_bits=None), **kw)

    f, g = open_cbk(shared), open_cbk(apart)
    assert f.config.tie_word_embeddings and not g.config.tie_word_embeddings
    assert _head_tensors(shared) == {"model.embed_tokens.codes": ("U8", (300, 64)),
                                     "model.embed_tokens.codebook_shared": ("F16", (1, 256)),
                                     "model.embed_tokens.row_scale": ("F16", (300,))}
    assert _head_tensors(apart) == {"model.embed_tokens.weight": ("F16", (300, 64)),
                                    "lm_head.codes": ("U8", (300, 64)),
                                    "lm_head.codebook_shared": ("F16", (1, 256)),
                                    "lm_head.row_scale": ("F16", (300,))}
    assert f.layers["model.embed_tokens.weight"].params == {"bits": 8, "codebook": "shared", "group_rows": 512}
    assert "lm_head.weight" not in f.layers
    # the shared table is the head's table (same k-means, same final-norm weighting), stored once
    for role in ("codes", "codebook_shared", "row_scale"):
        assert torch.equal(f.record("model.embed_tokens.weight").tensors[role],
                           g.record("lm_head.weight").tensors[role])
    saved = g.file_bytes - f.file_bytes
    assert abs(saved - 300 * 64 * 2) < 512, saved  # the fp16 embedding (a few header bytes aside)
    assert qm.config.tie_word_embeddings and "model.embed_tokens" in f.recipe["layer_errors"]

    m = trapetum.load(shared, dtype=torch.float32)
    head, emb = m.decoder.lm_head, m.decoder.model.embed_tokens
    assert head.codes.data_ptr() == emb.codes.data_ptr()  # one table in memory too
    ids = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64, 12, 5]])
    ours = m.logits(ids[0].tolist())
    ref = _hf_logits_from_dequantized(src, shared, ids)
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-4

    # export-aqlm writes the dequantized table as the (tied) HF embedding, no lm_head tensor
    out = export_aqlm(shared, tmp_path / "aqlm", log=lambda s: None)
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["tie_word_embeddings"]
    assert "lm_head" in hf_cfg["quantization_config"]["linear_weights_not_to_quantize"]
    st = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in st
    E = registry.dequantize(f.record("model.embed_tokens.weight"), torch.float32)
    assert st["model.embed_tokens.weight"].dtype == torch.float16
    assert torch.equal(st["model.embed_tokens.weight"].float(), E)
    back = trapetum.load(out, dtype=torch.float32).logits(ids[0].tolist())
    assert ((back - ours).norm() / ours.norm()).item() < 1e-5


@pytest.mark.slow  # 50 s on the CPU (CI budget); the untied and shared-table cases stay in the fast tier
def test_tied_resume_from_other_head_layout(tmp_path):
    # layer parts hold the projections only: parts left by a run with another head layout are reused,
    # and the resumed file equals an uninterrupted run's
    src = tmp_path / "hf"
    build("qwen2", src, tokenizer=True)
    rec = AdditiveRecipe(scheme="aqlm-2x8", **FAST)
    kw = dict(progress=False, provenance={"created": "fixed"})
    a, _ = quantize_additive_to_cbk(str(src), tmp_path / "a.cbk", rec, log=lambda s: None, **kw)
    with pytest.raises(KeyboardInterrupt):
        quantize_additive_to_cbk(str(src), tmp_path / "b.cbk", replace(rec, embed_bits=None), stop_after=1,
                                 log=lambda s: None, **kw)
    logs = []
    b, _ = quantize_additive_to_cbk(str(src), tmp_path / "b.cbk", rec, log=logs.append, **kw)
    assert any("(resumed)" in s for s in logs) and any("embed_tokens+lm_head (tied) 8-bit" in s for s in logs)
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.slow  # 20 s on the CPU (CI budget)
def test_untied_model_keeps_fp16_embedding_and_8bit_head(tmp_path):
    src = tmp_path / "hf"
    build("llama2", src, tokenizer=True)
    cbk, qm = quantize_additive_to_cbk(str(src), tmp_path / "q.cbk", AdditiveRecipe(scheme="aqlm-2x8", **FAST),
                                       progress=False, log=lambda s: None)
    f = open_cbk(cbk)
    assert not f.config.tie_word_embeddings and not qm.config.tie_word_embeddings
    assert _head_tensors(cbk) == {"model.embed_tokens.weight": ("F16", (300, 64)),
                                  "lm_head.codes": ("U8", (300, 64)),
                                  "lm_head.codebook_shared": ("F16", (1, 256)),
                                  "lm_head.row_scale": ("F16", (300,))}
    assert torch.equal(f.tensor("model.embed_tokens.weight"),
                       load_file(str(src / "model.safetensors"))["model.embed_tokens.weight"].half())
    ids = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64, 12, 5]])
    ours = trapetum.load(cbk, dtype=torch.float32).logits(ids[0].tolist())
    ref = _hf_logits_from_dequantized(src, cbk, ids)
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-4
    # the report carries the scalar report's two measures: rel_err is the plain relative error of the weights
    W = load_file(str(src / "model.safetensors"))
    for r in qm.report:
        if r["name"].startswith("model.layers."):
            assert 0 < r["rel_err_weighted"] < 1
            w = W[r["name"] + ".weight"].float()
            wq = registry.dequantize(f.record(r["name"] + ".weight"), torch.float32, r["name"])
            assert abs(r["rel_err"] - float((w - wq).norm() / w.norm())) < 1e-4
