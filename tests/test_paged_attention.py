"""Paged decode attention (kernels/paged_attention.py; the Triton kernel under TRITON_INTERPRET=1 on the CPU, on
the GPU there): against float64 over random lengths (1, 3, 16, 17, 53, 97, ...), GQA / MHA, sliding windows and
softcaps, and bitwise batch invariance: a sequence's row is the same alone, at another batch position, beside other
lengths, with a wider block table and with its blocks elsewhere; stale NaN blocks are never read."""
from __future__ import annotations

import random

import pytest
import torch

from kernels_conftest import DEVICE, rel_err
from trapetum.kernels import paged_attention as pa
from trapetum.kernels.triton_util import triton_ok

if not triton_ok(torch.device(DEVICE)):
    pytest.skip("Triton cannot run here (no GPU, no interpreter)", allow_module_level=True)

BS = 16


def _case(seed, S, hq, hkv, d, max_len, nblocks=None):
    """Random blocks (NaN in every block no sequence owns), S sequences of random lengths with shuffled tables."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    lens = [rng.choice([1, 3, 16, 17, 53, 97, rng.randrange(1, max_len + 1)]) for _ in range(S)]
    lens = [min(x, max_len) for x in lens]
    need = [(x + BS - 1) // BS for x in lens]
    nblocks = nblocks or sum(need) + 3
    ids = list(range(nblocks))
    rng.shuffle(ids)
    width = (max_len + BS - 1) // BS
    tables = torch.zeros(S, width, dtype=torch.int32)
    used = set()
    i = 0
    for s in range(S):
        for b in range(need[s]):
            tables[s, b] = ids[i]
            used.add(ids[i])
            i += 1
    k = torch.randn(nblocks, hkv, BS, d, generator=g).half()
    v = torch.randn(nblocks, hkv, BS, d, generator=g).half()
    for b in set(range(nblocks)) - used:
        k[b], v[b] = float("nan"), float("nan")
    q = torch.randn(S, hq, d, generator=g).half()
    return (q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), tables.to(DEVICE),
            torch.tensor(lens, dtype=torch.int32, device=DEVICE))


SHAPES = [(4, 2, 16), (4, 4, 32), (8, 1, 64)]  # (Hq, Hkv, D): GQA, MHA, one kv head


@pytest.mark.parametrize("hq,hkv,d", SHAPES)
@pytest.mark.parametrize("window,softcap", [(None, None), (24, None), (None, 30.0)])
def test_matches_float64(hq, hkv, d, window, softcap):
    for seed in range(2):
        q, k, v, tab, lens = _case(seed * 7 + d, 5, hq, hkv, d, 128)
        kw = dict(scale=d ** -0.5, window=window, softcap=softcap)
        got = pa.paged_attention(q, k, v, tab, lens, **kw)
        ref = pa.paged_attention_reference(q.cpu(), k.cpu(), v.cpu(), tab.cpu(), lens.cpu(), **kw)
        assert not torch.isnan(got).any()
        for s in range(q.shape[0]):
            assert rel_err(got[s].double().cpu(), ref[s]) < 3e-3, (s, int(lens[s]))


@pytest.mark.parametrize("hq,hkv,d", SHAPES[:2])
def test_rows_bitwise_independent_of_the_batch(hq, hkv, d):
    q, k, v, tab, lens = _case(11, 6, hq, hkv, d, 160)
    kw = dict(scale=d ** -0.5, window=40, softcap=20.0)
    full = pa.paged_attention(q, k, v, tab, lens, **kw)
    S = q.shape[0]
    for s in range(S):
        alone = pa.paged_attention(q[s:s + 1].contiguous(), k, v, tab[s:s + 1].contiguous(), lens[s:s + 1].contiguous(),
                                   **kw)
        assert torch.equal(full[s], alone[0]), s
        wide = torch.zeros(1, tab.shape[1] + 9, dtype=torch.int32, device=DEVICE)  # more chunks in the grid
        wide[0, :tab.shape[1]] = tab[s]
        assert torch.equal(pa.paged_attention(q[s:s + 1].contiguous(), k, v, wide, lens[s:s + 1].contiguous(), **kw)[0],
                           full[s]), s
    perm = list(reversed(range(S)))
    back = pa.paged_attention(q[perm].contiguous(), k, v, tab[perm].contiguous(), lens[perm].contiguous(), **kw)
    for i, s in enumerate(perm):
        assert torch.equal(back[i], full[s]), s
    # the sequences' blocks copied elsewhere (other ids, other neighbours)
    nb = k.shape[0]
    k2 = torch.cat([torch.full_like(k, float("nan")), k])
    v2 = torch.cat([torch.full_like(v, float("nan")), v])
    moved = pa.paged_attention(q, k2, v2, (tab + nb).contiguous(), lens, **kw)
    assert torch.equal(moved, full)


def test_bad_arguments():
    q, k, v, tab, lens = _case(0, 2, 4, 2, 16, 32)
    with pytest.raises(ValueError, match="block size"):
        pa.paged_attention(q, k[:, :, :8].contiguous(), v[:, :, :8].contiguous(), tab, lens, scale=0.25)
    with pytest.raises(ValueError, match="tables"):
        pa.paged_attention(q, k, v, tab[:1], lens, scale=0.25)


@pytest.mark.parametrize("hq,hkv,d,window,softcap", [(4, 4, 64, None, None), (8, 2, 128, 24, None),
                                                     (4, 1, 256, None, 30.0), (6, 3, 64, 40, 20.0)])
def test_chunk_bound_changes_no_bit(hq, hkv, d, window, softcap):
    """The split grid bounded to the chunks the longest row needs (or any bound above): against float64, and
    bitwise the output of the whole table's grid."""
    q, k, v, tab, lens = _case(d + hq, 4, hq, hkv, d, 300)
    kw = dict(scale=d ** -0.5, window=window, softcap=softcap)
    ref = pa.paged_attention_reference(q.cpu(), k.cpu(), v.cpu(), tab.cpu(), lens.cpu(), **kw)
    need = -(-int(lens.max()) // (pa.CHUNK_BLOCKS * BS))
    outs = [pa.paged_attention(q, k, v, tab, lens, max_chunks=c, **kw) for c in (None, need, need + 1, 1000)]
    for s in range(q.shape[0]):
        assert rel_err(outs[1][s].double().cpu(), ref[s]) < 3e-3, (s, int(lens[s]))
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    if need > 1:  # a bound below the longest row drops its chunks: the test can fail
        short = pa.paged_attention(q, k, v, tab, lens, max_chunks=need - 1, **kw)
        assert not torch.equal(short, outs[0])


def _rope_case(seed, S, hq, hkv, d, half, bs, max_len=200):
    """S rows at random positions (a run of consecutive ones for one sequence among them), their own blocks."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    width = (max_len + bs - 1) // bs
    nblocks = S * width + 2
    ids = list(range(nblocks))
    rng.shuffle(ids)
    tables = torch.tensor(ids[:S * width], dtype=torch.int32).view(S, width)
    pos = [rng.choice([0, 1, bs - 1, bs, 52, 96, rng.randrange(max_len)]) for _ in range(S)]
    if S >= 3:  # rows 1 .. S - 1 one sequence at consecutive positions (a replay)
        tables[1:] = tables[1]
        p0 = rng.randrange(max_len - S)
        pos[1:] = [p0 + i for i in range(S - 1)]
    qkv = torch.randn(S, (hq + 2 * hkv) * d, generator=g).half()
    q = qkv[:, :hq * d].view(S, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(S, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(S, hkv, d)
    kb = torch.randn(nblocks, hkv, bs, d, generator=g).half()
    vb = torch.randn(nblocks, hkv, bs, d, generator=g).half()
    from trapetum.kernels.fused import rope_tables
    cos, sin = rope_tables(max_len, 2 * half, theta=500.0)
    dev = [t.to(DEVICE) for t in (qkv, kb, vb, tables, torch.tensor(pos), cos, sin)]
    qkv_d = dev[0]
    qd = qkv_d[:, :hq * d].view(S, hq, d)
    kd = qkv_d[:, hq * d:(hq + hkv) * d].view(S, hkv, d)
    vd = qkv_d[:, (hq + hkv) * d:].view(S, hkv, d)
    return (q, k, v, kb, vb, tables, torch.tensor(pos), cos, sin), (qd, kd, vd, *dev[1:])


@pytest.mark.parametrize("S,hq,hkv,d,half,bs", [(1, 4, 4, 64, 32, 16), (5, 8, 2, 128, 64, 32),
                                               (3, 4, 1, 256, 128, 16), (7, 6, 3, 64, 16, 64),
                                               (4, 2, 2, 128, 32, 16)])
def test_rope_append_matches_float64(S, hq, hkv, d, half, bs):
    """q rotated in place, each row's k (rotated) and v in its block slot; partial rotary (half < D / 2) passes the
    rest through; no other slot changes; replay rows of one sequence land in consecutive slots."""
    host, dev = _rope_case(S * 31 + d, S, hq, hkv, d, half, bs)
    q0, k0, v0, kb0, vb0, tab, pos, cos, sin = host
    qref, kref, vref = pa.paged_rope_append_reference(q0, k0, v0, kb0, vb0, tab, pos, cos, sin)
    qd, kd, vd, kb, vb = dev[:5]
    out = pa.paged_rope_append(qd, kd, vd, kb, vb, *dev[5:])
    assert out is qd
    assert rel_err(qd, qref) < 1e-3
    touched = torch.zeros(kb.shape[0], kb.shape[2], dtype=torch.bool)
    for r in range(S):
        p = int(pos[r])
        touched[int(tab[r, p // bs]), p % bs] = True
    kbc, vbc = kb.cpu(), vb.cpu()
    sel = touched[:, None, :, None].expand_as(kbc)
    assert rel_err(kbc[sel], kref[sel]) < 1e-3
    assert torch.equal(vbc[sel].double(), vref[sel])
    assert torch.equal(kbc[~sel], kb0[~sel]) and torch.equal(vbc[~sel], vb0[~sel])


def test_rope_append_rows_bitwise_alone_and_as_rope_kv_append():
    """A row's bits are the same alone and in the batch, and the same as the engine's rope_kv_append of that row
    into a contiguous cache (the same expressions)."""
    from trapetum.kernels.fused import rope_kv_append
    S, hq, hkv, d, bs = 6, 8, 2, 128, 16
    host, dev = _rope_case(5, S, hq, hkv, d, 64, bs)
    qd, kd, vd, kb, vb, tab, pos, cos, sin = dev
    q_in, k_in, v_in = qd.clone(), kd.clone(), vd.clone()
    pa.paged_rope_append(qd, kd, vd, kb, vb, tab, pos, cos, sin)
    for r in (0, 2, 5):
        qa, kba, vba = q_in[r:r + 1].clone(), torch.zeros_like(kb), torch.zeros_like(vb)
        pa.paged_rope_append(qa, k_in[r:r + 1], v_in[r:r + 1], kba, vba, tab[r:r + 1].contiguous(),
                             pos[r:r + 1].contiguous(), cos, sin)
        p = int(pos[r])
        blk = int(tab[r, p // bs])
        assert torch.equal(qa[0], qd[r]), r
        assert torch.equal(kba[blk, :, p % bs], kb[blk, :, p % bs]) and torch.equal(vba[blk, :, p % bs], vb[blk, :, p % bs])
        qe = q_in[r:r + 1].clone()
        kc = torch.zeros(hkv, 200, d, dtype=torch.float16, device=DEVICE)
        vc = torch.zeros_like(kc)
        rope_kv_append(qe, k_in[r:r + 1], v_in[r:r + 1], kc, vc, p, cos, sin)
        assert torch.equal(qe[0], qd[r]) and torch.equal(kc[:, p], kb[blk, :, p % bs]), r
        assert torch.equal(vc[:, p], vb[blk, :, p % bs]), r


def test_rope_append_bad_arguments():
    _, dev = _rope_case(1, 2, 4, 2, 64, 32, 16)
    qd, kd, vd, kb, vb, tab, pos, cos, sin = dev
    with pytest.raises(ValueError, match="positions"):
        pa.paged_rope_append(qd, kd, vd, kb, vb, tab, pos[:1], cos, sin)
    with pytest.raises(ValueError, match="cos/sin"):
        pa.paged_rope_append(qd, kd, vd, kb, vb, tab, pos, cos.double(), sin)
    with pytest.raises(ValueError, match="do not match"):
        pa.paged_rope_append(qd, vd, kd[:, :1], kb, vb, tab, pos, cos, sin)


@pytest.mark.parametrize("S,bits", [(3, 4), (5, 8), (16, 4)])
def test_fragment_order_output_is_the_same_values(S, bits):
    """frag_bits: the merge writes the rows in the GEMV's fragment order: exactly to_fragments of the row-major
    output (the o-projection GEMV then skips its own copy)."""
    from trapetum.kernels.codebook_layout import Fragments, to_fragments
    q, k, v, tab, lens = _case(S + bits, S, 4, 2, 32, 100)
    kw = dict(scale=32 ** -0.5, window=30, softcap=None)
    plain = pa.paged_attention(q, k, v, tab, lens, **kw)
    fr = pa.paged_attention(q, k, v, tab, lens, frag_bits=bits, **kw)
    assert isinstance(fr, Fragments) and fr.bits == bits
    assert torch.equal(fr.data, to_fragments(plain, bits))
    with pytest.raises(ValueError, match="fragment order"):
        pa.paged_attention(q[:, :, :16].contiguous(), k[..., :16].contiguous(), v[..., :16].contiguous(), tab, lens,
                           scale=0.25, frag_bits=4)
