"""GGUF loading: synthetic files written with gguf.GGUFWriter (every family's conversion undone
exactly, bad input refused with the file named) and the real models against transformers'
own GGUF loading (config and every dequantized tensor)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from real_models import hf_reference, require  # noqa: E402
from trapetum.errors import ConfigError, FormatError, UnsupportedError  # noqa: E402
from trapetum.models.schema import expected_shapes  # noqa: E402
from trapetum.formats.gguf import config_from_gguf, default_model_path, load_gguf, open_gguf  # noqa: E402
from trapetum.models.config import ModelConfig  # noqa: E402

Q = gguf.GGMLQuantizationType

# -- synthetic files -----------------------------------------------------------------------------
TINY = dict(D=64, I=96, L=2, H=4, Hkv=2, hd=16, V=96)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's Q/K row permutation for the llama arch."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(arch: str, seed: int = 0, **over) -> dict[str, np.ndarray]:
    """Random weights under canonical (HF) names for a tiny model of this GGUF arch."""
    s = {**TINY, **over}
    rng = np.random.default_rng(seed)
    D, I, L, H, Hkv, hd, V = (s[k] for k in ("D", "I", "L", "H", "Hkv", "hd", "V"))
    cfg = ModelConfig(family=arch, vocab_size=V, hidden_size=D, intermediate_size=I, num_layers=L, num_heads=H,
                      num_kv_heads=Hkv, head_dim=hd, qkv_bias=arch == "qwen2", qk_norm=arch == "gemma3",
                      sandwich_norms=arch.startswith("gemma"), tie_word_embeddings=arch.startswith("gemma"))
    return {n: rng.standard_normal(shape).astype(np.float32) * (0.1 if len(shape) > 1 else 1.0)
            for n, shape in expected_shapes(cfg).items()}


def to_gguf_name(name: str, arch: str) -> str:
    table = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "post_feedforward_layernorm": "post_ffw_norm",
             "pre_feedforward_layernorm": "ffn_norm",
             "post_attention_layernorm": "post_attention_norm" if arch.startswith("gemma") else "ffn_norm"}
    if name.startswith("model.layers."):
        _, _, i, *rest = name.split(".")
        base, suffix = ".".join(rest[:-1]), rest[-1]
        return f"blk.{i}.{table[base]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], meta_over: dict | None = None,
               qtypes: dict[str, "gguf.GGMLQuantizationType"] | None = None, convert: bool = True,
               tokenizer: dict | None = None, extra_tensors: dict[str, np.ndarray] | None = None, **over) -> Path:
    """Write a GGUF the way llama.cpp's converter would (permute, +1 norms, fuse) from HF tensors."""
    s = {**TINY, **over}
    w = gguf.GGUFWriter(str(path), arch)
    meta = {"context_length": 128, "embedding_length": s["D"], "feed_forward_length": s["I"],
            "block_count": s["L"], "attention.head_count": s["H"], "attention.head_count_kv": s["Hkv"],
            "attention.key_length": s["hd"], "attention.value_length": s["hd"], "rope.freq_base": 10000.0,
            "attention.layer_norm_rms_epsilon": 1e-6, "vocab_size": s["V"]}
    if arch.startswith("gemma"):
        meta["attention.sliding_window"] = 8
    meta.update(meta_over or {})
    for k, v in meta.items():
        if v is None:
            continue
        key = f"{arch}.{k}" if not k.startswith(("general.", "tokenizer.")) else k
        (w.add_float32 if isinstance(v, float) else w.add_string if isinstance(v, str) else w.add_uint32)(key, v)
    for k, v in (tokenizer or {}).items():
        w.add_key_value(k, v[0], v[1]) if isinstance(v, tuple) else w.add_string(k, v)
    out: dict[str, np.ndarray] = {}
    for n, t in tensors.items():
        t = t.copy()
        if convert and arch == "llama" and (".q_proj." in n or ".k_proj." in n):
            t = _permute(t, s["H"] if ".q_proj." in n else s["Hkv"])
        if convert and arch.startswith("gemma") and n.endswith("norm.weight"):
            t = t + 1.0
        out[to_gguf_name(n, arch) if convert else n] = t
    if convert and arch == "phi3":
        for i in range(s["L"]):
            p = f"blk.{i}."
            out[p + "attn_qkv.weight"] = np.concatenate([out.pop(p + f"attn_{x}.weight") for x in "qkv"])
            out[p + "ffn_up.weight"] = np.concatenate([out.pop(p + "ffn_gate.weight"), out.pop(p + "ffn_up.weight")])
    out.update(extra_tensors or {})      # written as given (e.g. rope_freqs.weight)
    for n, t in out.items():
        qt = (qtypes or {}).get(n)
        if qt is None:
            w.add_tensor(n, t)
        else:
            w.add_tensor(n, gguf.quants.quantize(t, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


ARCHS = ["llama", "qwen2", "gemma2", "gemma3", "phi3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_synthetic_roundtrip_exact(tmp_path, arch):
    """What the converter did is undone exactly: permutation, +1 norms, fused projections."""
    ref = hf_tensors(arch)
    ck = load_gguf(write_gguf(tmp_path / f"{arch}.gguf", arch, ref))
    assert set(ck.tensors) == set(ref)
    for n, want in ref.items():
        got = ck.tensors[n]
        assert got.dtype == torch.float32 and tuple(got.shape) == want.shape, n
        torch.testing.assert_close(got, torch.from_numpy(want), rtol=0, atol=1e-6, msg=n)
        assert ck.tensors.formats[n] == "F32"
        assert ck.tensors.shapes[n] == want.shape
    c = ck.config
    assert ck.source_format == "gguf" and ck.tokenizer is None
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (64, 2, 4, 2, 16)
    assert c.tie_word_embeddings == arch.startswith("gemma")
    assert c.qkv_bias == (arch == "qwen2")


def test_synthetic_quantized_types(tmp_path):
    """Quantized tensors come back as gguf's dequantization of them, with their type recorded."""
    ref = hf_tensors("llama")
    types = {"blk.0.attn_q.weight": Q.Q8_0, "blk.0.ffn_up.weight": Q.Q4_0, "blk.1.ffn_down.weight": Q.Q5_1,
             "token_embd.weight": Q.Q4_1, "blk.1.attn_v.weight": Q.BF16, "blk.1.attn_k.weight": Q.Q5_0}
    types["blk.0.attn_output.weight"] = Q.F16
    ref16 = dict(ref)
    ref16["model.layers.0.self_attn.o_proj.weight"] = ref["model.layers.0.self_attn.o_proj.weight"].astype(np.float16)
    ck = load_gguf(write_gguf(tmp_path / "q.gguf", "llama", ref16, qtypes={k: v for k, v in types.items() if v != Q.F16}))
    fmt = ck.tensors.formats
    assert fmt["model.layers.0.self_attn.q_proj.weight"] == "Q8_0"
    assert fmt["model.embed_tokens.weight"] == "Q4_1"
    assert fmt["model.layers.0.self_attn.o_proj.weight"] == "F16"
    for n, want in ref.items():
        got = ck.tensors[n]
        rel = (got - torch.from_numpy(want)).norm() / torch.from_numpy(want).norm()
        assert rel < (0.2 if fmt[n].startswith("Q4") else 0.05), (n, fmt[n], float(rel))
    # Q/K: dequantized rows un-permuted equal the quantized-then-dequantized permuted rows, unpermuted
    q = _permute(ref["model.layers.0.self_attn.q_proj.weight"], 4)
    deq = gguf.quants.dequantize(gguf.quants.quantize(q, Q.Q8_0), Q.Q8_0)
    back = deq.reshape(4, 8, 2, -1).swapaxes(1, 2).reshape(deq.shape)  # inverse of _permute
    torch.testing.assert_close(ck.tensors["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(back),
                               rtol=0, atol=0)


def test_synthetic_gemma_config(tmp_path):
    ck = load_gguf(write_gguf(tmp_path / "g2.gguf", "gemma2", hf_tensors("gemma2", L=4), L=4,
                              meta_over={"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}))
    c = ck.config
    assert c.layer_types == ["sliding", "full", "sliding", "full"] and c.sliding_window == 8
    assert (c.attn_softcap, c.final_softcap, c.norm_offset, c.hidden_act) == (50.0, 30.0, 1.0, "gelu_tanh")
    assert c.embed_scale == pytest.approx(math.sqrt(64)) and c.sandwich_norms and not c.qk_norm
    assert c.attn_scale == pytest.approx(16 ** -0.5)
    ck = load_gguf(write_gguf(tmp_path / "g3.gguf", "gemma3", hf_tensors("gemma3", L=7), L=7,
                              meta_over={"rope.freq_base": 1e6}))
    c = ck.config
    assert c.layer_types == ["sliding"] * 5 + ["full", "sliding"]
    assert (c.rope_theta, c.rope_local_theta, c.qk_norm, c.final_softcap) == (1e6, 10000.0, True, None)
    # newer files state the pattern: a period, or one flag per layer (True = sliding)
    for pat, want in [(3, ["sliding", "sliding", "full"] * 2 + ["sliding"]),
                      ([True, False] * 3 + [True], ["sliding", "full"] * 3 + ["sliding"])]:
        gf = open_gguf(write_gguf(tmp_path / "g3p.gguf", "gemma3", hf_tensors("gemma3", L=7), L=7))
        c = config_from_gguf({**gf.metadata, "gemma3.attention.sliding_window_pattern": pat},
                             {t.name: t.shape for t in gf.tensors}, {}, str(gf.path))
        assert c.layer_types == want, pat


@pytest.mark.parametrize("hd,orig", [(128, 8192), (16, 64)])
def test_llama3_rope_freqs(tmp_path, hd, orig):
    """Llama-3.1's scaled RoPE is stored as a rope_freqs tensor; it becomes HF's llama3 rope_scaling."""
    theta = 500000.0
    want = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": orig}
    inv = theta ** (-np.arange(0, hd, 2) / hd)
    f = []
    for w in 2 * math.pi / inv:  # convert_hf_to_gguf's LlamaModel.generate_extra_tensors
        if w < orig / 4.0:
            f.append(1.0)
        elif w > orig / 1.0:
            f.append(8.0)
        else:
            s = (orig / w - 1.0) / (4.0 - 1.0)
            f.append(1 / ((1 - s) / 8.0 + s))
    shape = dict(hd=hd, H=2, Hkv=1, L=1)
    path = tmp_path / "l3.gguf"
    tensors = {to_gguf_name(n, "llama"): t for n, t in hf_tensors("llama", **shape).items()}
    tensors["rope_freqs.weight"] = np.array(f, dtype=np.float32)
    write_gguf(path, "llama", tensors, convert=False, meta_over={"rope.freq_base": theta}, **shape)
    c = load_gguf(path).config
    for k, v in want.items():
        assert c.rope_scaling[k] == (pytest.approx(v, rel=1e-3) if isinstance(v, float) else v), k
    # a rope_freqs tensor that follows no llama3 law is refused, naming the file
    tensors["rope_freqs.weight"] = np.linspace(1, 9, hd // 2).astype(np.float32)[::-1].copy()
    write_gguf(path, "llama", tensors, convert=False, meta_over={"rope.freq_base": theta}, **shape)
    with pytest.raises(UnsupportedError, match="l3.gguf"):
        load_gguf(path)


# -- bad input -------------------------------------------------------------------------------------
def _one_line(e: pytest.ExceptionInfo, path: Path) -> str:
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg, msg
    return msg


def test_missing_file(tmp_path):
    p = tmp_path / "nope.gguf"
    with pytest.raises(FormatError) as e:
        load_gguf(p)
    assert "not found" in _one_line(e, p)


@pytest.fixture
def tiny_llama(tmp_path) -> Path:
    return write_gguf(tmp_path / "tiny.gguf", "llama", hf_tensors("llama"))


@pytest.mark.parametrize("keep", [3, 16, 200, 0.5, -1])
def test_truncated(tmp_path, tiny_llama, keep):
    data = tiny_llama.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (len(data) + keep if keep < 0 else keep)
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:n])
    with pytest.raises(FormatError) as e:
        load_gguf(p)
    _one_line(e, p)


def test_bad_magic(tmp_path, tiny_llama):
    data = bytearray(tiny_llama.read_bytes())
    data[:4] = b"GGUX"
    p = tmp_path / "magic.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(FormatError) as e:
        load_gguf(p)
    assert "not a GGUF file" in _one_line(e, p)


@pytest.mark.parametrize("offset", [4, 8, 16, 24, 32])
def test_corrupted_header_bytes(tmp_path, tiny_llama, offset):
    """Garbage in the version, counts or the first key's length: refused, never a crash or a hang."""
    data = bytearray(tiny_llama.read_bytes())
    data[offset:offset + 8] = b"\xff\xfe\xfd\xfc\xfb\xfa\xf9\xf8"
    p = tmp_path / "corrupt.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises((FormatError, UnsupportedError)) as e:
        load_gguf(p)
    _one_line(e, p)


def test_unknown_arch(tmp_path):
    p = write_gguf(tmp_path / "mamba.gguf", "mamba", hf_tensors("llama"), convert=False)
    with pytest.raises(UnsupportedError) as e:
        load_gguf(p)
    assert "'mamba'" in _one_line(e, p)


def test_inconsistent_shape(tmp_path):
    t = hf_tensors("llama")
    t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"][:80]
    p = write_gguf(tmp_path / "shape.gguf", "llama", t)
    with pytest.raises(ConfigError) as e:
        load_gguf(p)
    assert "model.layers.1.mlp.up_proj.weight" in _one_line(e, p)


def test_metadata_disagrees_with_tensors(tmp_path):
    p = write_gguf(tmp_path / "heads.gguf", "qwen2", hf_tensors("qwen2"), meta_over={"attention.head_count_kv": 1})
    with pytest.raises(ConfigError) as e:
        load_gguf(p)
    assert "k_proj" in _one_line(e, p)


def test_missing_tensor_and_bad_metadata(tmp_path):
    t = hf_tensors("qwen2")
    del t["model.layers.0.self_attn.v_proj.bias"]
    p = write_gguf(tmp_path / "miss.gguf", "qwen2", t)
    with pytest.raises(ConfigError) as e:
        load_gguf(p)
    assert "v_proj.bias" in _one_line(e, p)
    p = write_gguf(tmp_path / "nometa.gguf", "qwen2", hf_tensors("qwen2"), meta_over={"block_count": None})
    with pytest.raises(ConfigError) as e:
        load_gguf(p)
    assert "block_count" in _one_line(e, p)


def test_bad_phi3_fused_rows(tmp_path):
    t = {to_gguf_name(n, "phi3"): v for n, v in hf_tensors("phi3").items()}
    p = tmp_path / "phi.gguf"
    write_gguf(p, "phi3", t, convert=False)  # unfused q/k/v: fine, loads as separate projections
    load_gguf(p)
    t["blk.0.attn_qkv.weight"] = np.zeros((100, 64), np.float32)
    write_gguf(p, "phi3", t, convert=False)
    with pytest.raises(ConfigError) as e:
        load_gguf(p)
    assert "attn_qkv" in _one_line(e, p)


def test_not_a_file(tmp_path):
    with pytest.raises(FormatError) as e:
        load_gguf(tmp_path)
    _one_line(e, tmp_path)


# -- real models -------------------------------------------------------------------------------------
def test_default_model_path():
    p = Path(default_model_path())
    assert p.is_file() and p.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    gf = open_gguf(p)
    assert gf.metadata["general.architecture"] == "llama"


def check_config_agrees(name: str):
    """Our config equals the one Trapetum derives from transformers' config of the same GGUF."""
    from trapetum.models.families import config_from_hf

    ours = load_gguf(require(name)).config
    hf = hf_reference(name, "config").to_dict()
    theirs = config_from_hf(hf, where="transformers config")
    assert ours.to_dict() == theirs.to_dict()
    # and field by field against transformers' own names
    rp = hf["rope_parameters"]
    full = rp.get("full_attention", rp)
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size, ours.num_layers) == \
        (hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"])
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == \
        (hf["num_attention_heads"], hf["num_key_value_heads"], hf.get("head_dim") or ours.head_dim)
    assert ours.rope_theta == full["rope_theta"] and ours.rms_norm_eps == hf["rms_norm_eps"]
    assert ours.tie_word_embeddings == hf["tie_word_embeddings"]
    assert ours.max_position_embeddings == hf["max_position_embeddings"]
    return ours, hf


def check_tensors_agree(name: str) -> float:
    """Every tensor equals transformers' GGUF-loaded state dict entry (same dequantization)."""
    sd = hf_reference(name, "model").state_dict()
    ck = load_gguf(require(name))
    assert set(ck.tensors) <= set(sd)
    assert set(sd) - set(ck.tensors) <= ({"lm_head.weight"} if ck.config.tie_word_embeddings else set())
    worst = 0.0
    for n in ck.tensors:
        a, b = ck.tensors[n], sd[n]
        assert a.shape == b.shape, n
        worst = max(worst, float((a - b).norm() / b.norm().clamp_min(1e-30)))
    assert worst <= 1e-6, worst
    return worst


def test_smollm2_config_agrees():
    ours, hf = check_config_agrees("smollm2")
    assert ours.family == "llama" and ours.tie_word_embeddings and ours.num_kv_heads == 3


def test_smollm2_tensors_agree():
    check_tensors_agree("smollm2")


@pytest.mark.slow
def test_gemma3_config_agrees():
    ours, hf = check_config_agrees("gemma3")
    assert ours.layer_types == [t.replace("_attention", "") for t in hf["layer_types"]]
    assert ours.sliding_window == hf["sliding_window"] == 512
    assert ours.rope_local_theta == hf["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert ours.attn_scale == hf["query_pre_attn_scalar"] ** -0.5
    assert ours.final_softcap == hf["final_logit_softcapping"] and ours.attn_softcap is None


@pytest.mark.slow
def test_gemma3_tensors_agree():
    check_tensors_agree("gemma3")


@pytest.mark.slow
def test_qwen25_config_agrees():
    ours, _ = check_config_agrees("qwen25")
    assert ours.qkv_bias and not ours.tie_word_embeddings


@pytest.mark.slow
def test_qwen25_tensors_agree():
    check_tensors_agree("qwen25")


def test_open_real_header_fast():
    """The header parser reads the default model's 49k-token vocabulary without gguf.GGUFReader."""
    gf = open_gguf(require("smollm2"))
    assert len(gf.metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(gf.tensors) == 272 and gf.tensors[0].name == "token_embd.weight"
    assert gf.tensors[0].tensor_type == Q.Q8_0 and gf.tensors[0].shape == (49152, 576)


def test_config_from_gguf_direct():
    meta = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.block_count": 2,
            "llama.attention.head_count": 4, "llama.feed_forward_length": 128, "llama.vocab_size": 100,
            "llama.attention.sliding_window": 32, "general.name": "Mistral tiny"}
    shapes = {"output.weight": (100, 64), "blk.0.attn_q.weight": (64, 64), "blk.1.attn_q.weight": (64, 64)}
    c = config_from_gguf(meta, shapes, {}, "x.gguf")
    assert c.family == "mistral" and c.layer_types == ["sliding", "sliding"] and c.sliding_window == 32
    assert c.num_kv_heads == 4 and c.head_dim == 16 and not c.tie_word_embeddings
    with pytest.raises(ConfigError, match="x.gguf.*block_count"):
        config_from_gguf({**meta, "llama.block_count": "two"}, {}, {}, "x.gguf")


def test_bad_tokenizer_metadata(tmp_path):
    """A vocabulary whose merges name unknown pieces, or an unknown tokenizer model: refused with the file."""
    arr = gguf.GGUFValueType.ARRAY
    tokens = [chr(c) for c in range(33, 33 + TINY["V"])]
    for tok, err in [({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": (tokens, arr),
                       "tokenizer.ggml.merges": (["! zz"], arr)}, FormatError),
                     ({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": (tokens, arr)}, UnsupportedError),
                     ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": (tokens, arr)}, FormatError)]:
        p = write_gguf(tmp_path / "tok.gguf", "llama", hf_tensors("llama"), tokenizer=tok)
        with pytest.raises(err) as e:
            load_gguf(p)
        _one_line(e, p)
    tokens = tokens[:-1] + ['!"']
    ok = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": (tokens, arr),
          "tokenizer.ggml.merges": (['! "'], arr)}
    tk = load_gguf(write_gguf(tmp_path / "ok.gguf", "llama", hf_tensors("llama"), tokenizer=ok)).tokenizer
    assert tk.encode('!"#', add_special_tokens=False) == [tokens.index('!"'), tokens.index("#")]


def test_random_corruption_fuzz(tmp_path):
    """Random byte flips and cuts in the header: every outcome is a load or a one-line project error."""
    import random

    from trapetum.errors import TrapetumError

    arr = gguf.GGUFValueType.ARRAY
    tokens = [chr(c) for c in range(33, 33 + TINY["V"] - 1)] + ['!"']
    src = write_gguf(tmp_path / "src.gguf", "qwen2", hf_tensors("qwen2"), tokenizer={
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": (tokens, arr),
        "tokenizer.ggml.merges": (['! "'], arr), "tokenizer.ggml.token_type": ([1] * len(tokens), arr)}).read_bytes()
    header = len(src) - sum(t.n_bytes for t in open_gguf(tmp_path / "src.gguf").tensors)
    rng = random.Random(0)
    p = tmp_path / "fuzz.gguf"
    for _ in range(150):
        b = bytearray(src)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(header)] = rng.randrange(256)
        if rng.random() < 0.3:
            b = b[:rng.randrange(len(b))]
        p.write_bytes(bytes(b))
        try:
            ck = load_gguf(p)
            for n in ck.tensors:
                ck.tensors[n]
        except TrapetumError as e:
            assert str(p) in str(e) and "\n" not in str(e), str(e)
