"""The verify contract on the GPU at real per-layer shapes (trapetum.eval.verify_exact): for M = 1, 2, 4, 8, 16 at
bases 6, 56 and 1,016 (attention over up to 17 chunks of 64), graphs captured at the first base and replayed at the
others, all state scrambled before every checked call: verify logits rows and KV rows bitwise equal to M decode
steps, and the next decode step too. 4-bit codebooks (Llama-2-7B MHA and Llama-3-8B GQA layers), AQLM 2x8, dense
fp16; with the default options, fusion off and the CUDA kernels off."""
import pytest
import torch

from trapetum.eval.verify_exact import SHAPES, VARIANTS, check, engine
from trapetum.settings import Options

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.gpu]


@pytest.mark.parametrize("variant", ["default", "fuse=off", "cuda-kernels=off"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_verify_rows_are_decode_steps(shape, variant):
    eng = engine(shape, Options().replace(**VARIANTS[variant]))
    res = check(eng, rows=(1, 2, 4, 8, 16), bases=(6, 56, 1016))
    assert len(res) == 15
    bad = [r for r in res if not r["ok"]]
    assert not bad, bad


@pytest.mark.parametrize("shape", ["cb4-mha", "cb4-gqa", "fp16"])
def test_short_prompts_take_the_exact_prefill(shape):
    """The default prefill of a codebook model's prompt of at most Options.exact_prefill_max tokens is the exact
    prefill (logits and cache rows bitwise, also when captured: the second call replays); longer prompts and dense
    models take the prompt pass."""
    eng = engine(shape, Options())
    codebook = shape.startswith("cb4")
    for T in (1, 29, 128, 129, 300):
        ids = torch.randint(0, eng.cfg.vocab_size, (T,), device="cuda", generator=torch.Generator("cuda").manual_seed(T))
        assert eng.short_exact(T) == (codebook and T <= 128)
        got = [eng.prefill(ids).clone() for _ in range(2)]
        k, v = eng.kv.k[:, :, :T].clone(), eng.kv.v[:, :, :T].clone()
        want = (eng.prefill_exact if eng.short_exact(T) else eng.prefill_pass)(ids).clone()
        assert torch.equal(got[0], want) and torch.equal(got[1], want)
        assert torch.equal(eng.kv.k[:, :, :T], k) and torch.equal(eng.kv.v[:, :, :T], v)
