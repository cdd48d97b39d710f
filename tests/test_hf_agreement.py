"""Every family: prompt logits and greedy tokens agree with Hugging Face transformers (fp32)."""
import pytest
import torch

import trapetum
from tests.tiny_models import FAMILIES, build


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for fam in FAMILIES:
        d = tmp_path_factory.mktemp(fam)
        out[fam] = (d, build(fam, d))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logits_and_greedy_match_hf(models, family):
    d, hf = models[family]
    m = trapetum.load(d)
    g = torch.Generator().manual_seed(1)
    T = 24  # longer than the sliding window (8) of mistral / gemma2 / gemma3
    ids = torch.randint(3, 300, (T,), generator=g).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = m.logits(ids)
    assert rel(ours, ref) < 1e-4, rel(ours, ref)

    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                             eos_token_id=None, pad_token_id=0)[0, T:].tolist()
    ours_out = m.generate(ids, max_new_tokens=32, temperature=0, ignore_eos=True).token_ids
    assert ours_out == hf_out


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_equals_prefill(models, family):
    d, _ = models[family]
    m = trapetum.load(d)
    ids = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    full = m.logits(ids)
    cache = m.decoder.new_cache(1, 32)
    steps = []
    with torch.no_grad():
        for i, t in enumerate(ids):
            steps.append(m.decoder(torch.tensor([[t]]), cache, i)[0, -1])
    assert rel(torch.stack(steps), full) < 1e-5
