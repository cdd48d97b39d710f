"""The padded, graph-captured default prefill (runtime/engine.py ``prefill_bucket``, ``Options.prefill_graph``):
the bucket rule, padding that leaves the real rows' logits as they were (CPU, in CI), and on the GPU the first
(eager) pass, the capture and the replays bitwise equal, equal to an engine with graphs off, close to the unpadded
prefill, and the same greedy continuation."""
import pytest
import torch

from tests.tiny_models import build
from trapetum.formats.detect import load_checkpoint
from trapetum.runtime.engine import GpuEngine, prefill_bucket
from trapetum.settings import Options

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel(a, b):
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def test_bucket_rule():
    prev = 0
    for t in range(1, 5000):
        b = prefill_bucket(t)
        assert b >= t and b % 16 == 0 and b >= prev
        assert b - t < max(16, t / 8 + 1), (t, b)
        prev = b
    assert [prefill_bucket(t) for t in (1, 16, 17, 100, 129, 1000, 1025)] == [16, 16, 32, 112, 144, 1024, 1152]
    with pytest.raises(ValueError, match="at least one token"):
        prefill_bucket(0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for fam in ("llama3", "gemma2", "qwen2"):
        d = tmp_path_factory.mktemp(fam)
        build(fam, d)
        out[fam] = load_checkpoint(str(d))
    return out


@pytest.mark.parametrize("family", ["llama3", "gemma2"])
def test_padded_pass_keeps_the_real_rows_cpu(checkpoints, family):
    """The padded pass (zero tokens after the prompt) gives the unpadded prompt's last logits: the pad rows come
    after the real ones and attention is causal (the CPU engine, kernels' torch / interpreter paths; its fp16
    products round differently at another row count: ~6e-4, where a pad row leaking into the real ones is O(1))."""
    eng = GpuEngine(checkpoints[family], 64, device="cpu", options=Options())
    ids = torch.arange(5, 5 + 11)
    ref = eng.prefill(ids)  # on the CPU the default prefill is not padded
    assert not eng._pads_prefill(11)
    got = eng._prefill_padded(ids)  # 16 rows, graphs off: the eager padded pass
    assert prefill_bucket(11) == 16 and rel(got, ref) < 2e-3


@gpu
@pytest.mark.parametrize("family", ["llama3", "gemma2", "qwen2"])
def test_graph_prefill_bitwise_and_close_to_unpadded(checkpoints, family):
    ck = checkpoints[family]
    eng = GpuEngine(ck, 128, device="cuda", options=Options())
    eager = GpuEngine(ck, 128, device="cuda", options=Options(graph=False))
    plain = GpuEngine(ck, 128, device="cuda", options=Options(prefill_graph=False))
    for T in (24, 21, 5):  # 21 shares the bucket of 24 (32 rows): replayed with another last row
        ids = torch.randint(3, 300, (T,), generator=torch.Generator().manual_seed(T))
        assert eng._pads_prefill(T) and not plain._pads_prefill(T)
        outs, caches = [], []
        for _ in range(3):  # eager first use, captured at the second, replayed at the third
            outs.append(eng.prefill(ids))
            caches.append(eng.kv.k[:, :, :T].clone())
        assert all(torch.equal(outs[0], o) for o in outs[1:]), family
        assert all(torch.equal(caches[0], c) for c in caches[1:])
        assert torch.equal(eager.prefill(ids), outs[0])
        assert torch.equal(eager.kv.k[:, :, :T], caches[0])
        assert rel(outs[0], plain.prefill(ids)) < 2e-3
    assert set(eng.prefill_graphs) == {32, 16}


@gpu
def test_graph_prefill_continues_like_graphs_off(checkpoints):
    from trapetum.runtime.sampling import GenerationSettings
    ck = checkpoints["llama3"]
    s = GenerationSettings(max_new_tokens=12, ignore_eos=True)
    eng = GpuEngine(ck, 128, device="cuda", options=Options())
    eager = GpuEngine(ck, 128, device="cuda", options=Options(graph=False))
    prompt = list(range(7, 37))
    runs = [list(eng.tokens(prompt, s, 60)) for _ in range(3)]  # eager, captured, replayed prefill
    assert runs[0] == runs[1] == runs[2] == list(eager.tokens(prompt, s, 60))
