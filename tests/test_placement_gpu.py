"""GPU-only checks of placement (runtime/placement.py; skipped without CUDA): tiny MoE models (4-bit .cbk) with their
routed experts in host RAM (runtime/host_experts.py) and the embedding there too, against the all-on-device engine:
prompt and step logits within 3e-3, the same greedy tokens, verify rows bitwise equal to decode steps; dense models
with the embedding on the host, the steps graph-captured: every logit bitwise the on-device engine's; the budget
through ``trapetum.load(..., gpu_mem=)``. The CPU versions: tests/test_placement.py."""
import pytest
import torch

import trapetum
from tests.tiny_models import MOE_FAMILIES, build, build_cbk
from trapetum.eval.verify_exact import check
from trapetum.formats.detect import load_checkpoint
from trapetum.runtime import placement as pl
from trapetum.runtime.engine import GpuEngine
from trapetum.runtime.sampling import GenerationSettings
from trapetum.settings import Options

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.gpu]
TOL = 3e-3


def rel(a, b):
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


def _ids():
    return torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(0)).tolist()


def _same_steps(ref, eng, ids, bitwise):
    a, b = ref.prefill(ids[:-4]), eng.prefill(ids[:-4])
    assert torch.equal(a, b) if bitwise else rel(b, a) < TOL
    for i, t in enumerate(ids[-4:]):
        for e in (ref, eng):
            e.set_position(t, 16 + i)
            e.step(greedy=False)
        assert torch.equal(eng.logits, ref.logits) if bitwise else rel(eng.logits, ref.logits) < TOL
    s = GenerationSettings(max_new_tokens=16)
    want = list(ref.tokens(ids, s, 36))
    assert list(eng.tokens(ids, s, 36)) == want
    return want


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_host_experts_give_the_on_device_tokens(tmp_path, family):
    ck = load_checkpoint(build_cbk(family, tmp_path, iters=2))
    ref = GpuEngine(ck, 64, device="cuda")
    eng = GpuEngine(ck, 64, device="cuda", placement=pl.Placement(embed_host=True, experts_host=True))
    assert ref.use_graph and not eng.use_graph  # host layers: eager steps
    assert eng.model.embed.device.type == "cpu"
    assert all(getattr(w.experts, "on_host", False) for L in eng.model.layers for k, w in L.blocks if k == "moe")
    assert eng.weight_bytes() < ref.weight_bytes() and eng.host_weight_bytes() > 0
    _same_steps(ref, eng, _ids(), bitwise=False)
    res = check(eng, rows=(1, 3, 16), bases=(6, 21))
    assert res and all(r["ok"] for r in res), [r for r in res if not r["ok"]]


@pytest.mark.parametrize("prefill_graph", [True, False])
@pytest.mark.parametrize("family", ["llama2", "qwen2", "gemma2"])
def test_embedding_on_the_host_keeps_the_graphs_and_the_bits(tmp_path, family, prefill_graph):
    """Steps captured as graphs on both; prompts padded on both (the host-table engine's padded prompt runs
    eagerly, the device engine's as its graph) or unpadded on both (Options.prefill_graph off), so every logit is
    the same bits."""
    build(family, tmp_path)
    ck = load_checkpoint(tmp_path)
    o = Options(prefill_graph=prefill_graph)
    ref = GpuEngine(ck, 64, device="cuda", options=o)
    eng = GpuEngine(ck, 64, device="cuda", options=o, placement=pl.Placement(embed_host=True))
    assert eng.use_graph and eng.host_embed and eng.embed_pinned.is_pinned()
    _same_steps(ref, eng, _ids(), bitwise=True)
    assert eng.graphs  # the steps replayed a captured graph
    for _ in range(3):  # the device engine's prompt: eager, then captured, then replayed; the host table's eager
        assert torch.equal(ref.prefill(_ids()[:-4]), eng.prefill(_ids()[:-4]))
    assert bool(ref.prefill_graphs) == prefill_graph and not eng.prefill_graphs
    rows_ref, rows = ref.verify(_ids()[:5], 3).clone(), eng.verify(_ids()[:5], 3)
    assert torch.equal(rows, rows_ref)


def test_gpu_mem_through_load(tmp_path):
    """A budget that fits only with the embedding and the routed experts in host RAM: planned so, the same greedy
    tokens as the model loaded without a budget; a budget under the margin: refused in one line."""
    path = build_cbk("qwen2_moe", tmp_path, iters=2)
    ck = load_checkpoint(path)
    sizes = pl.checkpoint_sizes(ck)
    experts = sum(n for k, n in sizes.items() if pl.is_routed_expert(k))
    plain = trapetum.load(path, device="cuda")
    kv = pl.kv_bytes(ck.config, plain.context_size)
    budget = (sum(sizes.values()) - sizes[pl.EMBED] - experts // 2 + kv + pl.MARGIN) / pl.GIB
    m = trapetum.load(path, device="cuda", gpu_mem=budget)
    p = m.engine.placement
    assert p.embed_host and p.experts_host and p.budget == int(budget * pl.GIB)
    ids = _ids()
    assert m.generate(ids, max_new_tokens=12, ignore_eos=True).token_ids == \
        plain.generate(ids, max_new_tokens=12, ignore_eos=True).token_ids
    with pytest.raises(pl.PlacementError) as e:
        trapetum.load(path, device="cuda", gpu_mem=0.5)
    assert "\n" not in str(e.value) and "--gpu-mem 0.5 GB" in str(e.value)


def test_a_roomy_budget_is_the_default_engine_bit_for_bit(tmp_path):
    """A budget everything fits in plans nothing to move: the same graphs and the same bits as no budget."""
    ck = load_checkpoint(build_cbk("qwen2_moe", tmp_path, iters=2))
    a = GpuEngine(ck, 64, device="cuda")
    b = GpuEngine(ck, 64, device="cuda", options=Options(gpu_mem_gb=100.0))
    assert a.placement is pl.ON_DEVICE and not b.placement.offloads and b.use_graph and not b.host_embed
    assert b.weight_bytes() == a.weight_bytes() and b.host_weight_bytes() == 0
    _same_steps(a, b, _ids(), bitwise=True)


def test_offload_benchmark_at_tiny_widths():
    """eval/bench_offload.py on the GPU at tiny widths (the H200 runs of BENCHMARKS.md at full width): a
    DeepSeek-V3-like slice with per-layer times (the profiling hook syncs between layers; the extrapolation is
    printed), and a dense 2x8 model under a budget that moves the embedding (steps still graphs, the same tokens,
    the GPU peak reported)."""
    from tests.test_offload_shapes import TINY_DENSE, TINY_V3
    from trapetum.eval import bench_offload as bo
    from trapetum.eval.random_model import random_sizes, shape_config
    with torch.inference_mode():
        r = bo.run("deepseek-v3", "cb4", layers=3, steps=4, per_layer=True, device="cuda", overrides=TINY_V3)
    assert list(r["rows"]) == ["gpu", "gpu-eager", "host-experts"] and r["extrapolation"]["moe"] == 4
    assert r["rows"]["gpu-eager"]["same_tokens"] == "4/4"  # graphs and eager steps: the same kernels
    assert all(r["rows"][n]["gpu_peak_gib"] > 0 for n in ("gpu", "host-experts"))
    assert "EXTRAPOLATED" in bo.markdown(r)
    cfg = shape_config("llama2-70b", overrides=TINY_DENSE)
    sizes = random_sizes("llama2-70b", "aqlm-2x8", overrides=TINY_DENSE)
    need = bo.needs(sizes, cfg, pl.kv_bytes(cfg, bo.PROMPT + bo.WARMUP + 4 + 16), tied=False)
    mid = (need["everything on the GPU"] + need["embedding in host RAM"]) / 2
    with torch.inference_mode():
        r = bo.run("llama2-70b", "aqlm-2x8", steps=4, gpu_mem=mid, device="cuda", overrides=TINY_DENSE)
    row = r["rows"]["embed-host"]
    assert r["placed"].startswith("planned") and row["same_tokens"] == "4/4" and row["gpu_peak_gib"] < mid
