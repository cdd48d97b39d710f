"""The host GEMV on the shared codebook storage (kernels/host_gemv.py ``SharedTables``, host/codebook_host.c):
each row's table formed in C from its group's table and its row scale (fp32 product, one round to nearest even)
instead of read from decoded per-row tables. Contracts: the tables are bitwise ``decode_shared``'s on every code
path this CPU runs (ties and fp16 subnormals included); the GEMV's results are bitwise the per-row call's on the
decoded tables (same path, same per-row order) for random shapes (awkward sizes, G not dividing N), M = 1 and a
few M, threads 1 and 2; against the float64 reference; the CPU modules and decode paths keep the shared storage
as stored (no per-row tables) and give the bits of the expanded file."""
from __future__ import annotations

import math
import random
from fractions import Fraction

import numpy as np
import pytest
import torch

import trapetum
from cbk_helpers import tiny_config, tiny_tokenizer
from trapetum.formats.cbk import write_cbk
from trapetum.kernels import host_gemv as hg
from trapetum.kernels import host_ops as ho
from trapetum.kernels.pack import pack_codes, unpack_codes
from trapetum.models.schema import expected_shapes
from trapetum.schemes.codebook import CODEBOOK, CodebookLinear
from trapetum.schemes.codebook_store import decode_shared, expand
from trapetum.schemes.record import QuantRecord

if not hg.available():
    pytest.skip(f"host kernels unavailable: {hg.error()}", allow_module_level=True)

AWKWARD = (1, 3, 53, 97, 257)
PATHS = hg.PATHS[: hg.PATHS.index(hg.best_path()) + 1]  # every path this CPU runs


def _shared(bits, N, G, gen, tiny=False):
    """Random shared tables: fp16 group tables and row scales; ``tiny``: scales that put many centroids among
    the fp16 subnormals (and some exactly at a rounding tie)."""
    sh = torch.randn(-(-N // G), 1 << bits, generator=gen).to(torch.float16)
    lo, hi = (-22.0, -12.0) if tiny else (-6.0, 2.0)
    sc = torch.exp2(lo + (hi - lo) * torch.rand(N, generator=gen)) * torch.sign(torch.randn(N, generator=gen))
    return hg.SharedTables(sh, sc.to(torch.float16), G)


def _case(bits, M, N, K, G, seed, tiny=False):
    gen = torch.Generator().manual_seed(seed)
    codes = pack_codes(torch.randint(0, 1 << bits, (N, K), generator=gen), bits)
    return torch.randn(M, K, generator=gen), codes, _shared(bits, N, G, gen, tiny)


def _rel(y, ref):
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _shapes(n, seed=0):
    rng = random.Random(seed)
    pick = lambda lo, hi: rng.choice(AWKWARD) if rng.random() < 0.4 else rng.randint(lo, hi)  # noqa: E731
    out = []
    for _ in range(n):
        N = pick(1, 300)
        G = rng.choice((1, 2, 3, 7, 53, 64, 512, N, N + 5))  # G dividing N or not, one group, G > N
        out.append((rng.choice((4, 8)), rng.choice((1, 1, 2, 3, 5, 16)), N, pick(1, 600), G))
    return out


SHAPES = _shapes(200)


@pytest.mark.parametrize("chunk", range(4))
def test_bitwise_the_per_row_call_on_the_decoded_tables_and_near_float64(chunk):
    for i, (bits, M, N, K, G) in enumerate(SHAPES[chunk::4]):
        x, codes, st = _case(bits, M, N, K, G, seed=chunk * 1000 + i, tiny=i % 5 == 0)
        full = decode_shared(st.shared, st.scale, G)
        ref = hg.reference(x, codes, st, bits, K)
        assert torch.equal(hg.reference(x, codes, full, bits, K), ref)  # the float64 reference's own decode
        scale = hg.reference(x.abs(), codes, hg.SharedTables(st.shared.abs(), st.scale.abs(), G), bits, K).norm()
        for path in PATHS:
            want = hg.codebook_gemv_host(x, codes, full, bits, K, threads=1, path=path)
            for t in (1, 2):
                y = hg.codebook_gemv_host(x, codes, st, bits, K, threads=t, path=path)
                assert torch.equal(y, want), (bits, M, N, K, G, path, t)
            err = float((y.double() - ref).norm() / scale.clamp_min(1e-30))  # fp32 rounding of sum |x w|
            assert err < 2e-6, (bits, M, N, K, G, path, err)
            if M > 1:  # batch invariance on the shared path too
                assert torch.equal(hg.codebook_gemv_host(x[-1:], codes, st, bits, K, path=path), y[-1:])


@pytest.mark.skipif("avx512vbmi" not in PATHS, reason="the CPU has no AVX-512 VBMI")
@pytest.mark.parametrize("chunk", range(2))
def test_avx512vbmi_4bit_gives_avx512_s_bits(chunk):
    """The avx512vbmi path's 4-bit GEMV is avx512's (M = 1 in its own row loop) bit for bit: 100 random shapes (K
    around the blocks of 32 and 128 among them), both table storages, M = 1..16, threads 1 and 3."""
    rng = random.Random(14 + chunk)
    for i in range(50):
        K = rng.choice((1, 31, 32, 33, 63, 64, 65, 127, 128, 129, 191, 192, 193, 576, 896)) if i % 2 else \
            rng.randint(1, 1100)
        N, M = rng.choice((1, 3, 53, rng.randint(1, 300))), rng.choice((1, 1, 2, 3, 4, 5, 16))
        G = rng.choice((1, 7, 64, 512, N + 5))
        x, codes, st = _case(4, M, N, K, G, seed=chunk * 1000 + i, tiny=i % 7 == 0)
        for tab in (st, decode_shared(st.shared, st.scale, G)):
            want = hg.codebook_gemv_host(x, codes, tab, 4, K, threads=1, path="avx512")
            for t in (1, 3):
                y = hg.codebook_gemv_host(x, codes, tab, 4, K, threads=t, path="avx512vbmi")
                assert torch.equal(y, want), (M, N, K, G, t)


def _r32(f: Fraction) -> float:
    """The exact rational f rounded to fp32 (nearest, ties to even; normal range)."""
    if f == 0:
        return 0.0
    e = math.frexp(float(f))[1]
    while abs(f) * Fraction(2) ** (24 - e) < 2 ** 23:
        e -= 1
    while abs(f) * Fraction(2) ** (24 - e) >= 2 ** 24:
        e += 1
    return float(np.float32(round(f * Fraction(2) ** (24 - e)) * Fraction(2) ** (e - 24)))


def _bytes_order_emulated(x, w):
    """host/codebook_host.c row8_bytes for one row of x and one weight row w (fp32 values), emulated exactly: blocks
    of 64 columns, quarter q's lane i takes column 64 b + xorder64(q, i) into accumulator q by one fp32 FMA (padding
    columns multiply x's zeros), then ((a0 + a1) + (a2 + a3)) and _mm512_reduce_add_ps's tree (GCC)."""
    f32 = np.float32
    K = len(x)
    acc = [[f32(0)] * 16 for _ in range(4)]
    for b in range(0, K, 64):
        for q in range(4):
            for i in range(16):
                k = b + 16 * (2 * (q & 1) + i // 8) + 8 * (q >> 1) + i % 8
                if k < K:
                    acc[q][i] = f32(_r32(Fraction(float(w[k])) * Fraction(float(x[k])) + Fraction(float(acc[q][i]))))
    v = [(acc[0][i] + acc[1][i]) + (acc[2][i] + acc[3][i]) for i in range(16)]
    t3 = [v[8 + i] + v[i] for i in range(8)]
    t6 = [t3[4 + i] + t3[i] for i in range(4)]
    return float((t6[0] + t6[2]) + (t6[1] + t6[3]))


@pytest.mark.skipif("avx512vbmi" not in PATHS, reason="the CPU has no AVX-512 VBMI")
def test_avx512vbmi_8bit_is_the_byte_lookup_s_order_exactly():
    """The 8-bit byte-plane lookup of avx512vbmi (and avx512fp16, the same function) is bitwise its documented
    sequence of fp32 FMAs and adds (an exact emulation): K around the blocks of 64, both storages, threads 1 and 3,
    M = 3 (batch invariance: every row of x its M = 1 sequence)."""
    rng = random.Random(18)
    for i, K in enumerate((1, 5, 63, 64, 65, 127, 128, 129, 200, 257)):
        N, G = rng.randint(1, 5), rng.choice((1, 2, 512))
        x, codes, st = _case(8, 3, N, K, G, seed=500 + i, tiny=i % 4 == 3)
        w = decode_shared(st.shared, st.scale, G).float()
        idx = unpack_codes(codes, 8, K).long()
        want = torch.tensor([[_bytes_order_emulated(x[m].numpy(), w[n][idx[n]].numpy()) for n in range(N)]
                             for m in range(3)])
        for tab in (st, decode_shared(st.shared, st.scale, G)):
            for t in (1, 3):
                y = hg.codebook_gemv_host(x, codes, tab, 8, K, threads=t, path="avx512vbmi")
                assert torch.equal(y, want), (N, K, G, t, (y - want).abs().max())


@pytest.mark.parametrize("bits", (4, 8))
def test_every_formed_table_entry_is_decode_shared_s(bits):
    """One-hot inputs read the tables out exactly: Y[e, n] = table_n[e] (x = identity over K = 2**bits columns,
    code k = k): every entry of every row, on every path, for scales in the normal and the subnormal range
    (thousands of entries: rounding ties occur among them)."""
    E = 1 << bits
    idx = torch.arange(E).repeat(300, 1)
    codes = pack_codes(idx, bits)
    eye = torch.eye(E)
    for tiny, G in ((False, 7), (True, 3), (True, 512)):
        st = _shared(bits, 300, G, torch.Generator().manual_seed(bits + G), tiny)
        full = decode_shared(st.shared, st.scale, G).float()
        assert tiny or bool((full != 0).all())
        if tiny:
            assert bool(((full.abs() < 2 ** -14) & (full != 0)).any())  # fp16 subnormals among them
        for path in PATHS:
            y = hg.codebook_gemv_host(eye, codes, st, bits, E, threads=1, path=path)
            assert torch.equal(y.T, full), (bits, tiny, G, path)
        assert torch.equal(hg.HostGemv(codes, st, bits, E).dequantize(), full)  # the C decode of prefill


def test_host_gemv_object_bytes_dequantize_matmul_and_checks():
    x, codes, st = _case(8, 40, 257, 97, 53, seed=3)
    g = hg.HostGemv(codes, st, 8, 97)
    assert g.nbytes == codes.numel() + st.shared.numel() * 2 + st.scale.numel() * 2
    full = decode_shared(st.shared, st.scale, 53)
    assert hg.HostGemv(codes, full, 8, 97).nbytes == codes.numel() + full.numel() * 2
    w = torch.gather(full.float(), 1, unpack_codes(codes, 8, 97).long())
    assert torch.equal(g.dequantize(), w) and torch.equal(g.dequantize(50, 60), w[50:60])
    assert _rel(g.matmul(x, rows=64), hg.reference(x, codes, st, 8, 97)) < 2e-6
    assert torch.equal(g(x[:3], 2), hg.codebook_gemv_host(x[:3], codes, full, 8, 97, threads=1))
    with pytest.raises(ValueError, match="group_rows"):
        hg.HostGemv(codes, hg.SharedTables(st.shared, st.scale, 0), 8, 97)
    with pytest.raises(ValueError, match="shared tables must be"):
        hg.HostGemv(codes, hg.SharedTables(st.shared[:-1], st.scale, 53), 8, 97)
    with pytest.raises(ValueError, match="row scales must be"):
        hg.HostGemv(codes, hg.SharedTables(st.shared, st.scale.float(), 53), 8, 97)


def test_fused_gemv_mixes_the_storages_bitwise():
    gen = torch.Generator().manual_seed(9)
    K = 53
    parts, full = [], []
    for i, (N, G) in enumerate(((97, 5), (3, 512), (257, 1))):
        codes = pack_codes(torch.randint(0, 16, (N, K), generator=gen), 4)
        st = _shared(4, N, G, gen)
        tab = st if i != 1 else decode_shared(st.shared, st.scale, G)  # a per-row part among shared ones
        parts.append((codes, tab, None))
        full.append((codes, decode_shared(st.shared, st.scale, G), None))
    x = torch.randn(5, K, generator=gen)
    for t in (1, 2):
        assert torch.equal(ho.FusedGemv(parts, 4, K)(x, threads=t), ho.FusedGemv(full, 4, K)(x, threads=1))
    g = ho.FusedGemv([parts[0], (parts[0][0], parts[0][1], None)], 4, K, act="silu")
    assert torch.equal(g(x), ho.FusedGemv([full[0], full[0]], 4, K, act="silu")(x))


def _shared_record(shape, bits, G, gen):
    out, inp = shape
    st = _shared(bits, out, G, gen)
    codes = pack_codes(torch.randint(0, 1 << bits, (out, inp), generator=gen), bits)
    return QuantRecord("codebook", (out, inp), {"bits": bits, "codebook": "shared", "group_rows": G},
                       {"codes": codes, "codebook_shared": st.shared, "row_scale": st.scale})


def test_the_module_keeps_the_shared_storage_and_matches_the_expanded_one():
    rec = _shared_record((257, 97), 8, 53, torch.Generator().manual_seed(4))
    mod, ref = CODEBOOK.module(rec, "w"), CODEBOOK.module(expand(rec), "w")
    assert "codebook" not in dict(mod.named_buffers()) and mod.group_rows == 53
    assert mod.storage_bytes() == rec.tensors["codes"].numel() + (5 * 256 + 257) * 2  # ceil(257 / 53) groups
    assert torch.equal(mod.centroids(), ref.codebook) and torch.equal(mod.dequantize(), ref.dequantize())
    assert mod.use_host() and ref.use_host() and isinstance(mod.host.tables, hg.SharedTables)
    x = torch.randn(3, 97)
    assert torch.equal(mod(x), ref(x))
    ids = torch.tensor([[0, 256, 53], [52, 1, 106]])
    emb = CODEBOOK.embedding(rec, "e", torch.float32, None)
    assert torch.equal(emb(ids), CODEBOOK.embedding(expand(rec), "e", torch.float32, None)(ids))
    assert torch.equal(emb.as_linear().row_scale, emb.row_scale)  # the tied head shares the stored tensors
    back = mod.to_record()
    assert back.params == rec.params and all(torch.equal(back.tensors[k], v) for k, v in rec.tensors.items())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One tiny model twice: its 8-bit head (and a q projection) in the shared storage, and the same records
    expanded to per-row fp16 tables."""
    cfg = tiny_config(vocab_size=257, hidden_size=53, intermediate_size=97, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    gen = torch.Generator().manual_seed(5)
    dense, quantized = {}, {}
    for name, shape in expected_shapes(cfg).items():
        if name == "lm_head.weight":
            quantized[name] = _shared_record(shape, 8, 53, gen)
        elif name == "model.layers.0.self_attn.q_proj.weight":
            quantized[name] = _shared_record(shape, 4, 7, gen)
        elif name.endswith("_proj.weight"):
            quantized[name] = expand(_shared_record(shape, 4, 3, gen))
        elif "norm" in name:
            dense[name] = (1 + 0.1 * torch.randn(shape, generator=gen)).to(torch.float16)
        else:
            dense[name] = (0.5 * torch.randn(shape, generator=gen)).to(torch.float16)
    d = tmp_path_factory.mktemp("shared")
    write_cbk(d / "shared.cbk", config=cfg, dense=dense, quantized=quantized, tokenizer=tiny_tokenizer())
    write_cbk(d / "full.cbk", config=cfg, dense=dense, tokenizer=tiny_tokenizer(),
              quantized={k: expand(v) for k, v in quantized.items()})
    return d / "shared.cbk", d / "full.cbk"


IDS = [1, 5, 6, 7, 8, 5, 9, 3, 4, 200, 17, 256, 2, 40]


@pytest.mark.parametrize("step", (True, False))
def test_cpu_decode_paths_read_the_shared_tables_and_give_the_expanded_file_s_bits(files, step):
    from trapetum.settings import Options
    shared, full = (trapetum.load(f, options=Options(cpu_step=step), threads=2) for f in files)
    head = shared.decoder.lm_head
    assert isinstance(head, CodebookLinear) and head.group_rows == 53 and not hasattr(head, "codebook")
    assert isinstance(head.host.tables, hg.SharedTables)
    assert torch.equal(shared.logits(IDS), full.logits(IDS))
    a = shared.generate(IDS[:4], max_new_tokens=8, ignore_eos=True).token_ids
    assert a == full.generate(IDS[:4], max_new_tokens=8, ignore_eos=True).token_ids
