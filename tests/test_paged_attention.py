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
