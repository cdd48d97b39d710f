"""A GGUF's legacy block-quantized projections read in place on the CPU (scheme "ggml", schemes/ggml.py;
kernels/ggml_host.py): the records are the file's rows (q / k un-permuted, fused tensors split) and dequantize to
exactly the dense tensors; a model decodes through them with the dense path's tokens and logits (up to the order of
the sums), the same bits at every thread count and for each row of a multi-row pass; hostile scales are refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import trapetum  # noqa: E402
from real_models import ModelUnavailable, smollm2_path  # noqa: E402
from test_gguf import hf_tensors, to_gguf_name, write_gguf  # noqa: E402
from trapetum.errors import FormatError  # noqa: E402
from trapetum.formats.gguf import load_gguf, open_gguf  # noqa: E402
from trapetum.kernels import ggml_host  # noqa: E402
from trapetum.models.decoder import Decoder  # noqa: E402
from trapetum.schemes.ggml import GgmlLinear  # noqa: E402
from trapetum.settings import Options  # noqa: E402

if not ggml_host.available():
    pytest.skip("host kernels unavailable", allow_module_level=True)

Q = gguf.GGMLQuantizationType
CYCLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0)


def _quantized(arch: str, tensors: dict, head: bool = True) -> dict:
    """GGUF name -> a block type for every 2-D tensor (cycling the four legacy types), the embedding Q8_0."""
    names = [to_gguf_name(n, arch) for n, t in tensors.items() if t.ndim == 2]
    if arch == "phi3":  # the fused tensors the writer makes
        names = [n for n in names if not any(s in n for s in ("attn_q.", "attn_k.", "attn_v.", "ffn_gate."))]
        names += [f"blk.{i}.attn_qkv.weight" for i in range(2)]
    out = {n: CYCLE[i % 4] for i, n in enumerate(sorted(names))}
    out["token_embd.weight"] = Q.Q8_0
    if not head:
        out.pop("output.weight", None)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "phi3"])
def test_records_are_the_rows_as_stored_and_dequantize_to_the_dense_tensors(tmp_path, arch):
    ref = hf_tensors(arch)
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, ref, qtypes=_quantized(arch, ref))
    ck = load_gguf(path)
    seen = 0
    for n in ck.tensors:
        rec = ck.tensors.record(n)
        if rec is None:
            continue
        seen += 1
        assert rec.scheme == "ggml" and rec.params["type"] == ck.tensors.formats[n]
        assert tuple(rec.shape) == tuple(ck.tensors.shapes[n])
        mod = GgmlLinear.from_record(rec, n)
        assert mod.use_host(1)
        assert torch.equal(mod.dequantize(), ck.tensors[n]), n  # bitwise gguf's dequantization, as loaded
    projections = [n for n in ck.tensors if n.endswith("_proj.weight") or n == "lm_head.weight"]
    assert seen == len(projections) + 1  # every projection and the embedding
    assert ck.tensors.record("model.norm.weight") is None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "phi3"])
def test_a_model_decodes_through_the_blocks_as_through_the_dense_weights(tmp_path, arch):
    ref = hf_tensors(arch)
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, ref, qtypes=_quantized(arch, ref))
    m = trapetum.load(str(path))
    dec = m.decoder
    ggml = [mod for mod in dec.modules() if isinstance(mod, GgmlLinear)]
    n_proj = sum(1 for name in dec.projections())
    assert len(ggml) == n_proj and all(mod.host is not None for mod in ggml)  # the tied head too (gemma3)
    assert dec.cpu_step is not None
    dense = trapetum.load(str(path), options=Options(host_kernels=False)).decoder
    assert not any(isinstance(mod, GgmlLinear) for mod in dense.modules())
    tokens = [1, 5, 9, 14, 3, 22, 7, 30, 11, 4, 18, 25]

    def run(d, threads=None):
        if threads is not None:
            d.cpu_step.threads = threads
        cache = d.new_cache(1, 64)
        with torch.inference_mode():
            rows = [d(torch.tensor([tokens[:6]]), cache, 0)[0]]
            for i, t in enumerate(tokens[6:]):
                rows.append(d(torch.tensor([[t]]), cache, 6 + i)[0])
            multi = d(torch.tensor([tokens[6:9]]), d.new_cache(1, 64), 0)[0]  # a 3-row pass: rows as steps
        return torch.cat(rows), multi

    got, multi = run(dec)
    want, _ = run(dense)
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()) + 1e-6
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for t in (1, 2, 3):  # every thread count, the same bits
        g, mu = run(dec, threads=t)
        assert torch.equal(g, got) and torch.equal(mu, multi)
    # batch invariance: each row of a multi-row pass is bitwise that row decoded as a one-row step
    cache = dec.new_cache(1, 64)
    with torch.inference_mode():
        steps = [dec(torch.tensor([[t]]), cache, i)[0] for i, t in enumerate(tokens[6:9])]
    assert torch.equal(torch.cat(steps), multi)


def test_prefill_of_many_rows_multiplies_the_same_weights(tmp_path):
    ref = hf_tensors("llama")
    path = write_gguf(tmp_path / "l.gguf", "llama", ref, qtypes=_quantized("llama", ref))
    dec = trapetum.load(str(path)).decoder
    dense = Decoder.from_checkpoint(load_gguf(path)).eval()
    toks = torch.tensor([list(range(1, 41))])  # 40 rows: past the GEMV's 16, the dequantized matmul
    with torch.inference_mode():
        a = dec(toks, dec.new_cache(1, 64), 0)
        b = dense(toks, dense.new_cache(1, 64), 0)
    assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())


def _patch_first_scale(path, tensor: str, value: int):
    f = open_gguf(path)
    t = next(t for t in f.tensors if t.name == tensor)
    begin = t.data_offset
    with open(path, "r+b") as fh:
        fh.seek(begin)
        fh.write(np.array([value], dtype=np.uint16).tobytes())


@pytest.mark.parametrize("bits", [0x7C00, 0x7E00])  # an infinite and a NaN scale
def test_hostile_scales_are_refused_naming_the_tensor(tmp_path, bits):
    ref = hf_tensors("llama")
    path = write_gguf(tmp_path / "h.gguf", "llama", ref, qtypes=_quantized("llama", ref))
    _patch_first_scale(path, "blk.0.ffn_down.weight", bits)
    ck = load_gguf(path)
    with pytest.raises(FormatError, match="ffn_down"):
        ck.tensors.record("model.layers.0.mlp.down_proj.weight")
    with pytest.raises(FormatError, match="ffn_down"):
        Decoder.from_checkpoint(ck, blocks=True)


def test_the_embedded_default_decodes_through_its_blocks():
    try:
        path = smollm2_path()
    except ModelUnavailable as e:
        pytest.skip(str(e))
    m = trapetum.load(str(path))
    dec = m.decoder
    kinds = {type(mod).__name__ for mod in dec.projections().values()}
    assert kinds == {"GgmlLinear"}  # Q4_1 projections, the Q8_0 tied head
    ids = m.encode("The capital of France is")
    got = m.generate(ids, max_new_tokens=8, ignore_eos=True)
    dense = trapetum.load(str(path), options=Options(host_kernels=False))
    want = dense.generate(ids, max_new_tokens=8, ignore_eos=True)
    assert got.token_ids == want.token_ids


def test_fused_block_gemv_of_mixed_types_is_the_single_gemvs_plus_epilogue():
    """host_ops.FusedGemv over GGUF block weights (bits ggml_host.BITS, the CPU step's calls): the parts' types may
    differ; bitwise the single GEMVs side by side, + bias, + residual; act(gate) * up within fp32 rounding."""
    from trapetum.kernels import host_ops as ho

    g = np.random.default_rng(5)
    K, N = 96, 37
    ws = [ggml_host.GgmlWeight(t.name, torch.from_numpy(gguf.quants.quantize(
        g.standard_normal((N, K)).astype(np.float32), t)), K) for t in (Q.Q8_0, Q.Q4_1)]
    x = torch.from_numpy(g.standard_normal((3, K)).astype(np.float32))
    bias, res = torch.randn(2 * N), torch.randn(3, 2 * N)
    singles = torch.cat([ggml_host.ggml_gemv_host(x, w) for w in ws], 1)
    for threads in (1, 2, 3):
        f = ho.FusedGemv([(w.blocks, w, bias[i * N:(i + 1) * N]) for i, w in enumerate(ws)], ggml_host.BITS, K)
        assert torch.equal(f(x, residual=res, threads=threads), res + (singles + bias))
        act = ho.FusedGemv([(w.blocks, w, None) for w in ws], ggml_host.BITS, K, act="silu")(x, threads=threads)
        assert torch.allclose(act, torch.nn.functional.silu(singles[:, :N]) * singles[:, N:], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):  # a block part must carry its own GgmlWeight
        ho.FusedGemv([(ws[0].blocks, ws[1], None)], ggml_host.BITS, K)


def test_the_loader_offers_exactly_the_types_the_kernel_reads():
    from trapetum.formats.gguf import BLOCK_TYPES

    assert set(BLOCK_TYPES) == set(ggml_host.GGML_TYPES)
    assert all(BLOCK_TYPES[t] == ggml_host.GGML_TYPES[t][1] for t in BLOCK_TYPES)  # bytes a block


def test_the_scheme_check_refuses_blocks_whose_weights_leave_the_fp16_range():
    """A ggml record from elsewhere (a .cbk layer) is checked as the GGUF loader checks: finite, within fp16."""
    from trapetum.schemes.ggml import GGML
    from trapetum.schemes.record import QuantRecord

    b = torch.from_numpy(gguf.quants.quantize(np.ones((2, 64), np.float32), Q.Q8_0).copy())
    GGML.check(QuantRecord("ggml", (2, 64), {"type": "Q8_0"}, {"blocks": b}), "w")
    b[0, 0:2] = torch.from_numpy(np.array([0x7C00], np.uint16).view(np.uint8))  # d = inf
    with pytest.raises(FormatError, match="out-of-range"):
        GGML.check(QuantRecord("ggml", (2, 64), {"type": "Q8_0"}, {"blocks": b}), "w")


def test_batched_decode_of_a_gguf_gives_each_request_its_tokens_alone(tmp_path):
    """The CPU scheduler's forwards run the blocks' fused GEMVs over every row (batch-invariant for any M)."""
    ref = hf_tensors("llama")
    m = trapetum.load(str(write_gguf(tmp_path / "b.gguf", "llama", ref, qtypes=_quantized("llama", ref))))
    prompts = [[1, 5, 9], [2, 7, 11, 13, 4], [3], [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 20]]
    got = m.generate_batch(prompts, max_new_tokens=6, ignore_eos=True)
    for p, c in zip(prompts, got):
        assert c.token_ids == m.generate(p, max_new_tokens=6, ignore_eos=True).token_ids
