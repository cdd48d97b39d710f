"""Shared checks of a tiny family against Hugging Face transformers (fp32), for tests/test_moe.py, test_mla.py and
test_rope_variants.py: prompt logits, greedy tokens, decode against prefill, VERIFY rows against decode steps."""
from __future__ import annotations

import torch

from trapetum.models.batch import Mode

LOGIT_TOL = 1e-4  # max |ours - hf| over the prompt's logits, relative to max |hf| (and the relative norm)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_logits_match(model, hf, ids: list[int]) -> None:
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = model.logits(ids)
    scale = float(ref.abs().max())
    err = float((ours - ref).abs().max()) / scale
    rel = float((ours - ref).norm() / ref.norm())
    assert err < LOGIT_TOL and rel < LOGIT_TOL, (len(ids), err, rel)


def assert_greedy_match(model, hf, ids: list[int], n: int = 16) -> list[int]:
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    ours = model.generate(ids, max_new_tokens=n, temperature=0, ignore_eos=True).token_ids
    assert ours == theirs
    return ours


def assert_decode_equals_prefill(model, ids: list[int], tol: float = 1e-5) -> None:
    full = model.logits(ids)
    dec = model.decoder
    cache = dec.new_cache(1, len(ids) + 8)
    with torch.no_grad():
        steps = torch.stack([dec(torch.tensor([[t]]), cache, i)[0, -1] for i, t in enumerate(ids)])
    rel = float((steps - full).norm() / full.norm())
    assert rel < tol, rel


def assert_verify_rows_are_decode_steps(model, seed: int = 1) -> None:
    """TorchOps in VERIFY mode: row r of an M-row forward is bitwise the one-token forward at base + r, cache too."""
    dec = model.decoder
    g = torch.Generator().manual_seed(seed)
    for base, m in ((6, 1), (5, 4), (9, 7)):
        pre = torch.randint(3, 300, (1, base), generator=g)
        rows = torch.randint(3, 300, (1, m), generator=g)
        c1, c2 = dec.new_cache(1, 32), dec.new_cache(1, 32)
        with torch.no_grad():
            dec(pre, c1, 0)
            dec(pre, c2, 0)
            steps = [dec(rows[:, r:r + 1], c1, base + r)[0, 0] for r in range(m)]
            ver = dec(rows, c2, base, mode=Mode.VERIFY)[0]
        assert all(torch.equal(ver[r], steps[r]) for r in range(m)), (base, m)
        for a, b in zip(c1.k + c1.v, c2.k + c2.v):
            assert torch.equal(a[:, :, :base + m], b[:, :, :base + m])


def build_models(tmp_path_factory, families) -> dict:
    """family -> (its directory, the transformers model, trapetum.load of it), each built by tiny_models.build."""
    import trapetum
    from tests.tiny_models import build
    out = {}
    for fam in families:
        d = tmp_path_factory.mktemp(fam)
        out[fam] = (d, build(fam, d), trapetum.load(d))
    return out
