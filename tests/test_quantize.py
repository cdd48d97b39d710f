"""End to end: a tiny random Llama (transformers, saved to tmp) -> trapetum quantize -> .cbk -> load."""
from __future__ import annotations

import math

import pytest
import torch

import trapetum
from trapetum.schemes.codebook import CodebookLinear
from trapetum.quant.quantize import Recipe, quantize_checkpoint, quantize_to_cbk
from trapetum.schemes.codebook_store import expand


def _tiny_llama(path, tie: bool, bias: bool = False, dtype: torch.dtype = torch.float32):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    if bias:
        cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                       tie_word_embeddings=tie)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                       tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
        model = transformers.LlamaForCausalLM(cfg)
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(96)}
    vocab.update({"<s>": 1, "</s>": 2, "<unk>": 0})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return _tiny_llama(tmp_path_factory.mktemp("tiny"), tie=True)


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("calib") / "calib.txt"
    g = torch.Generator().manual_seed(1)
    p.write_text(" ".join(f"t{i}" for i in torch.randint(3, 96, (4000,), generator=g).tolist()))
    return p


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("calib", ["file", "sampled", "none"])
def test_quantize_tiny_end_to_end(tiny_dir, calib_file, tmp_path, calib):
    recipe = Recipe(bits=4, head_bits=8, embed_bits=None,
                    calib=str(calib_file) if calib == "file" else ("none" if calib == "none" else None),
                    weighted=calib != "none", calib_seqs=4, calib_len=64, calib_sample_len=32, iters=20)
    out = tmp_path / "tiny.cbk"
    path, qm = quantize_to_cbk(str(tiny_dir), out, recipe, progress=False, log=lambda s: None)
    assert path.is_file()
    # every layer projection reported, with a finite relative error well below 1
    assert len([r for r in qm.report if r["name"].startswith("model.layers.")]) == 2 * 7
    assert all(0 <= r["rel_err"] < 0.2 for r in qm.report)
    # 4-bit codes + 16 fp16 centroids per row of 64 (or 96) inputs
    assert 4.0 < qm.bits_per_weight("projections") < 4 + 256 / 64 + 1e-9
    ref = trapetum.load(str(tiny_dir))
    q = trapetum.load(str(out))
    # read back: the decoder's projections are CodebookLinear and equal what we wrote
    mod = q.decoder.get_submodule("model.layers.1.mlp.down_proj")
    assert isinstance(mod, CodebookLinear) and mod.bits == 4
    rec = expand(qm.quantized["model.layers.1.mlp.down_proj.weight"])  # stored "u8": the decoded fp16 book
    assert torch.equal(mod.codes.cpu(), rec.tensors["codes"]) and torch.equal(mod.codebook.cpu(), rec.tensors["codebook"])
    head = q.decoder.get_submodule("lm_head")
    assert isinstance(head, CodebookLinear) and head.bits == 8
    assert not q.config.tie_word_embeddings  # 8-bit head stored apart from the fp16 embedding
    toks = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        lr, lq = ref.decoder(toks), q.decoder(toks)
    assert _rel(lq, lr) < 0.25
    # the file's recipe says what was done


def test_overrides_keep_fp16_and_layer_bits(tiny_dir, tmp_path):
    recipe = Recipe(bits=4, head_bits=None, weighted=False, calib="none", iters=10,
                    keep_fp16=["model.layers.0.self_attn.q_proj"], bits_overrides=[("*.mlp.down_proj", 8), ("*.k_proj", 2)])
    from trapetum.api import load_checkpoint

    ckpt = load_checkpoint(str(tiny_dir))
    qm = quantize_checkpoint(ckpt, recipe, progress=False, log=lambda s: None)
    assert "model.layers.0.self_attn.q_proj.weight" in qm.dense
    assert qm.quantized["model.layers.1.self_attn.q_proj.weight"].params["bits"] == 4
    assert qm.quantized["model.layers.0.mlp.down_proj.weight"].params["bits"] == 8
    assert qm.quantized["model.layers.0.self_attn.k_proj.weight"].params["bits"] == 2
    assert "lm_head.weight" not in qm.quantized and qm.config.tie_word_embeddings  # head kept fp16: still tied
    path, _ = quantize_to_cbk(str(tiny_dir), tmp_path / "o.cbk", recipe, progress=False, log=lambda s: None)
    m = trapetum.load(str(path))
    assert m.decoder.get_submodule("model.layers.0.self_attn.k_proj").bits == 2


@pytest.mark.parametrize("embed_bits", [8, "auto"])
def test_tied_8bit_embedding_shares_one_table(tiny_dir, tmp_path, embed_bits):
    # the default ("auto") gives a tied model one 8-bit table for embedding and head
    recipe = Recipe(bits=3, head_bits=8, embed_bits=embed_bits, weighted=False, calib="none", iters=10)
    path, qm = quantize_to_cbk(str(tiny_dir), tmp_path / "e.cbk", recipe, progress=False, log=lambda s: None)
    assert "model.embed_tokens.weight" in qm.quantized and "lm_head.weight" not in qm.quantized
    assert qm.config.tie_word_embeddings
    m = trapetum.load(str(path))
    ids = torch.tensor([[5, 7, 9]])
    emb = m.decoder.model.embed_tokens(ids)
    W = torch.gather(expand(qm.quantized["model.embed_tokens.weight"]).tensors["codebook"].float(), 1,
                     __import__("trapetum.kernels.pack", fromlist=["x"]).unpack_codes(
                         qm.quantized["model.embed_tokens.weight"].tensors["codes"], 8, 64).long())
    assert torch.equal(emb[0], W[[5, 7, 9]])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_untied_float_source_keeps_its_embedding_fp16(tmp_path, dtype):
    """``--embed-bits auto`` on an untied fp16 / bf16 HF source: the embedding stays dense fp16, the plan equals
    ``embed_bits=None``'s (only a source stored at 8 bits or fewer gets the 8-bit table: source_bits.py)."""
    from trapetum.api import load_checkpoint
    from trapetum.quant.quantize import plan_quantization
    ck = load_checkpoint(str(_tiny_llama(tmp_path / "m", tie=False, dtype=dtype)))
    assert ck.tensor_formats()["model.embed_tokens.weight"] == {torch.float16: "F16", torch.bfloat16: "BF16"}[dtype]
    auto, fp16 = (plan_quantization(ck, Recipe(embed_bits=eb)) for eb in ("auto", None))
    assert "model.embed_tokens.weight" not in auto.quantized and auto.dense["model.embed_tokens.weight"].dtype == "F16"
    assert auto.dense == fp16.dense and auto.quantized == fp16.quantized
    assert "model.embed_tokens.weight" in plan_quantization(ck, Recipe(embed_bits=8)).quantized


def test_untied_qkv_bias_model(tmp_path):
    d = _tiny_llama(tmp_path / "qwen", tie=False, bias=True)
    recipe = Recipe(bits=4, head_bits=8, weighted=True, calib=None, calib_seqs=2, calib_sample_len=16, iters=10)
    path, qm = quantize_to_cbk(str(d), tmp_path / "q.cbk", recipe, progress=False, log=lambda s: None)
    rec = qm.quantized["model.layers.0.self_attn.q_proj.weight"]
    assert rec.bias is not None and rec.bias.shape == (64,)
    ref, q = trapetum.load(str(d)), trapetum.load(str(path))
    toks = torch.randint(3, 96, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert _rel(q.decoder(toks), ref.decoder(toks)) < 0.25
    assert math.isfinite(qm.bits_per_weight("all"))


@pytest.mark.parametrize("bias", [False, True])
def test_layerwise_calibration_equals_full_model(tmp_path, bias):
    from trapetum.api import load_checkpoint
    from trapetum.models.decoder import Decoder
    from trapetum.quant.calibrate import collect_input_stats, collect_input_stats_layerwise

    ck = load_checkpoint(str(_tiny_llama(tmp_path / "m", tie=not bias, bias=bias)))
    toks = torch.randint(3, 96, (3, 24), generator=torch.Generator().manual_seed(5))
    full = collect_input_stats(Decoder.from_checkpoint(ck).eval(), toks, batch=2, progress=False)
    lw = collect_input_stats_layerwise(ck, toks, batch=2, progress=False)
    assert sorted(full) == sorted(lw) and "lm_head" in lw and len(lw) == 2 * 7 + 1
    for k in full:
        assert torch.allclose(full[k], lw[k], rtol=1e-5, atol=1e-8), k
