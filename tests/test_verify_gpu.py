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
