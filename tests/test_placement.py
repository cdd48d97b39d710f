"""Placement under a GPU memory budget (runtime/placement.py) and the tensors it puts in host RAM, on the CPU: the
planner's decisions over sizes (order, tied heads, refusals), the checkpoint's size estimates against the loaded
records, the host experts (runtime/host_experts.py) against the float64 all-experts reference and their contracts
(rows batch-invariant, every thread count the same bits), and the engine (on the CPU, the kernels' torch fallbacks)
forced to offload against the all-on-device engine: the same greedy tokens, verify rows bitwise equal to decode
steps, the embedding-on-host input path bitwise. The GPU runs the same in tests/test_placement_gpu.py."""
import types

import pytest
import torch

import trapetum
from tests.tiny_models import MOE_FAMILIES, build, build_cbk
from trapetum.errors import TrapetumError, UnsupportedError
from trapetum.eval.random_model import random_codebook
from trapetum.eval.verify_exact import check
from trapetum.formats.detect import load_checkpoint
from trapetum.kernels import host_gemv as hg
from trapetum.models.config import ModelConfig
from trapetum.runtime import placement as pl
from trapetum.runtime.engine import GpuEngine
from trapetum.runtime.sampling import GenerationSettings
from trapetum.schemes import registry
from trapetum.settings import Options

G = pl.GIB
MOE = ModelConfig(family="mixtral", vocab_size=100, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                  num_kv_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  mlp_types=["moe", "moe"]).validate("test")
DENSE = ModelConfig(family="llama", vocab_size=100, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                    num_kv_heads=2, head_dim=8).validate("test")


def moe_sizes(embed=2 * G, experts=6 * G, rest=3 * G) -> dict:
    s = {pl.EMBED: embed, "model.layers.0.self_attn.q_proj.weight": rest}
    for e in range(3):
        s[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = experts // 3
    return s


# -- the planner -----------------------------------------------------------------------------------------
def test_no_budget_is_everything_on_the_device():
    assert pl.plan(moe_sizes(), MOE, G, None) is pl.ON_DEVICE
    p = pl.plan(moe_sizes(), MOE, G, 100 * G, margin=G)
    assert not p.offloads and p.gpu_bytes == 11 * G and p.host_bytes == 0 and p.budget == 100 * G


@pytest.mark.parametrize("budget, embed, experts", [(13, False, False), (12.9, True, False), (11, True, False),
                                                    (10.9, True, True), (5, True, True)])
def test_the_embedding_moves_first_then_the_experts(budget, embed, experts):
    """11 GB of weights (2 embedding, 6 routed experts, 3 rest) + 1 KV cache + 1 margin."""
    p = pl.plan(moe_sizes(), MOE, G, int(budget * G), margin=G)
    assert (p.embed_host, p.experts_host) == (embed, experts)
    moved = 2 * G * embed + 6 * G * experts
    assert p.host_bytes == moved and p.gpu_bytes == 11 * G - moved
    assert p.gpu_bytes + p.kv_bytes + p.margin <= p.budget
    assert "GPU" in p.describe() and "\n" not in p.describe()


def test_refusal_names_the_budget_and_the_need():
    with pytest.raises(pl.PlacementError) as e:
        pl.plan(moe_sizes(), MOE, G, int(4.5 * G), margin=G, source="m.cbk")
    msg = str(e.value)
    assert "\n" not in msg and "--gpu-mem 4.5 GB" in msg and "m.cbk needs 5.00 GB" in msg
    assert "embedding and routed experts in host RAM" in msg and "KV cache 1.00 GB" in msg
    with pytest.raises(pl.PlacementError, match="must be positive"):
        pl.plan(moe_sizes(), MOE, G, 0)


def test_dense_model_moves_only_its_embedding():
    sizes = {pl.EMBED: 2 * G, "model.layers.0.mlp.down_proj.weight": 3 * G}
    assert pl.plan(sizes, DENSE, 0, 4 * G, margin=0).embed_host
    with pytest.raises(pl.PlacementError, match="even with its embedding in host RAM"):
        pl.plan(sizes, DENSE, 0, 2 * G, margin=0)


def test_a_table_the_head_shares_stays_on_the_device():
    """A dense head tied to the table keeps it on the GPU: moving it saves nothing, so the experts go first."""
    p = pl.plan(moe_sizes(), MOE, G, 11 * G, margin=G, tied_dense_embed=True)
    assert (p.embed_host, p.experts_host) == (False, True)
    with pytest.raises(pl.PlacementError, match="even with its routed experts in host RAM"):
        pl.plan(moe_sizes(), MOE, G, 4 * G, margin=G, tied_dense_embed=True)


def test_kv_bytes_match_the_engine_cache(tmp_path):
    build("deepseek_v2", tmp_path / "mla")
    build("mixtral", tmp_path / "mx")
    for d in ("mla", "mx"):
        ck = load_checkpoint(tmp_path / d)
        for mla in ("expanded", "latent") if d == "mla" else ("expanded",):
            eng = GpuEngine(ck, 24, device="cpu", options=Options(mla=mla))
            assert pl.kv_bytes(ck.config, 24, latent=mla == "latent") == eng.kv.nbytes()


def test_checkpoint_sizes_from_labels_match_the_records(tmp_path):
    ck = load_checkpoint(build_cbk("qwen2_moe", tmp_path, iters=1))
    sizes = pl.checkpoint_sizes(ck)
    assert set(sizes) == set(ck.tensors)
    for name in ck.tensors:
        assert sizes[name] == pl.engine_bytes(ck.tensors[name]), name
    assert any(pl.is_routed_expert(n) for n in sizes) and pl.EMBED in sizes


# -- host experts ----------------------------------------------------------------------------------------
needs_host = pytest.mark.skipif(not hg.available(), reason=f"host kernels unavailable: {hg.error()}")


def _experts(E, D, F, bits, seed=0, act="silu", up_bits=None):
    from trapetum.runtime.host_experts import HostExperts
    g = torch.Generator().manual_seed(seed)
    tensors, names = {}, []
    for e in range(E):
        n = {r: f"model.layers.0.mlp.experts.{e}.{r}_proj" for r in ("gate", "up", "down")}
        for r, (o, i) in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
            rec = random_codebook(o, i, up_bits if r == "up" and up_bits else bits, "cpu", g)
            rec.tensors["codebook"] = rec.tensors["codebook"] * 20  # weights of order one
            tensors[n[r] + ".weight"] = rec
        names.append(n)
    ck = types.SimpleNamespace(tensors=tensors)
    return HostExperts.build(ck, names, act, "test"), ck, names


def _reference(ck, names, x, w, idx, act="silu"):
    """float64: sum_j w[m, j] * down(act(gate(x)) * up(x)) of expert idx[m, j] (every expert dequantized)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for m in range(x.shape[0]):
        for j in range(idx.shape[1]):
            n = names[int(idx[m, j])]
            W = {r: registry.dequantize(ck.tensors[n[r] + ".weight"], torch.float64) for r in n}
            g, u = W["gate"] @ x[m].double(), W["up"] @ x[m].double()
            a = (g * torch.sigmoid(g) if act == "silu" else torch.nn.functional.gelu(g, approximate="tanh")) * u
            out[m] += float(w[m, j]) * (W["down"] @ a)
    return out


def _routing(M, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    return torch.rand(M, k, generator=g), idx


@needs_host
@pytest.mark.parametrize("bits, up_bits", [(4, None), (8, None), (4, 8)])
@pytest.mark.parametrize("D, F, M, E", [(3, 53, 1, 5), (53, 97, 3, 5), (97, 3, 16, 5), (64, 257, 20, 5),
                                        (257, 1, 5, 5), (53, 97, 20, 2)])
def test_host_experts_against_the_float64_reference(bits, up_bits, D, F, M, E):
    """Gate and up of one bit width take the fused gate/up call, of two the separate GEMVs; E = 2 with k = 2 gives
    each expert 20 rows: the dequantized-block matmul of a prompt."""
    k = 2
    hx, ck, names = _experts(E, D, F, bits, seed=D + F + bits, up_bits=up_bits)
    assert all((g is None) == (up_bits is not None) for g in hx.gate_up)
    x = torch.randn(M, D, generator=torch.Generator().manual_seed(M)).half().float()
    w, idx = _routing(M, E, k, D * F)
    got = hx.compute(x, w, idx, torch.empty(M, D))
    want = _reference(ck, names, x, w, idx)
    assert float((got.double() - want).norm() / want.norm()) < 2e-3  # a rounded to fp16 between the GEMVs
    y = hx.run(x.half(), w, idx, None)  # the device path with CPU tensors: the same host work
    assert y.dtype == torch.float16 and torch.equal(y, got.half())


@needs_host
@pytest.mark.parametrize("bits", [4, 8])
def test_host_experts_rows_are_batch_invariant_and_thread_count_free(bits):
    E, k, D, F, M = 6, 3, 53, 97, 16
    hx, _, _ = _experts(E, D, F, bits, act="gelu_tanh")
    x = torch.randn(M, D, generator=torch.Generator().manual_seed(1))
    w, idx = _routing(M, E, k, 2)
    full = hx.compute(x, w, idx, torch.empty(M, D), threads=1)
    assert torch.equal(full, hx.compute(x, w, idx, torch.empty(M, D), threads=2))
    for m in (0, 7, 15):
        assert torch.equal(full[m:m + 1], hx.compute(x[m:m + 1], w[m:m + 1], idx[m:m + 1], torch.empty(1, D)))


@needs_host
def test_host_experts_refuse_other_schemes_in_one_line():
    from trapetum.runtime.host_experts import HostExperts
    names = [{r: f"model.layers.0.mlp.experts.0.{r}_proj" for r in ("gate", "up", "down")}]
    g = torch.Generator().manual_seed(0)
    for bad in (torch.zeros(8, 8, dtype=torch.float16), random_codebook(8, 8, 2, "cpu", g)):
        tensors = {n + ".weight": random_codebook(8, 8, 4, "cpu", g) for n in names[0].values()}
        tensors[names[0]["gate"] + ".weight"] = bad
        with pytest.raises(UnsupportedError) as e:
            HostExperts.build(types.SimpleNamespace(tensors=tensors), names, "silu", "m.cbk")
        msg = str(e.value)
        assert "\n" not in msg and "m.cbk" in msg and "experts.0.gate_proj" in msg and "4- or 8-bit codebook" in msg


# -- the engine forced to offload ---------------------------------------------------------------------
pytestmark = pytest.mark.usefixtures("torch_fallbacks", "one_thread")  # tests/conftest.py


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _compare(ck, placement, n_new=16, tol=2e-3, bitwise=False):
    ids = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = GpuEngine(ck, 48, device="cpu")
    eng = GpuEngine(ck, 48, device="cpu", placement=placement)
    assert eng.placement is placement and ref.placement is pl.ON_DEVICE
    a, b = ref.prefill(ids[:-4]), eng.prefill(ids[:-4])
    assert torch.equal(a, b) if bitwise else rel(b, a) < tol
    for i, t in enumerate(ids[-4:]):
        for e in (ref, eng):
            e.set_position(t, 16 + i)
            e.step(greedy=False)
        assert torch.equal(eng.logits, ref.logits) if bitwise else rel(eng.logits, ref.logits) < tol
    s = GenerationSettings(max_new_tokens=n_new)
    assert list(eng.tokens(ids, s, 20 + n_new)) == list(ref.tokens(ids, s, 20 + n_new))
    res = check(eng, rows=(1, 3, 16), bases=(6,))
    assert res and all(r["ok"] for r in res), [r for r in res if not r["ok"]]
    return eng


@needs_host
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_engine_with_host_experts_gives_the_on_device_tokens(tmp_path, family):
    ck = load_checkpoint(build_cbk(family, tmp_path, iters=2))
    eng = _compare(ck, pl.Placement(embed_host=True, experts_host=True))
    sets = [w.experts for L in eng.model.layers for kind, w in L.blocks if kind == "moe"]
    assert sets and all(getattr(s, "on_host", False) for s in sets)
    assert eng.model.embed.device.type == "cpu" and eng.host_weight_bytes() > 0


@pytest.mark.parametrize("family", ["llama2", "qwen2", "gemma2"])
def test_embedding_on_the_host_is_bitwise_the_device_path(tmp_path, family):
    """Dense models (qwen2 and gemma2 tie the head to the table: the head keeps its own device copy; gemma2 scales
    the rows): the uploaded rows are the gathered rows, so every logit is the same bits."""
    build(family, tmp_path)
    eng = _compare(load_checkpoint(tmp_path), pl.Placement(embed_host=True), bitwise=True)
    assert eng.host_embed and eng.host_weight_bytes() == eng.model.embed.numel() * 2


def test_default_and_a_roomy_budget_change_nothing(tmp_path):
    build("qwen2_moe", tmp_path)
    ck = load_checkpoint(tmp_path)
    a = GpuEngine(ck, 24, device="cpu")
    b = GpuEngine(ck, 24, device="cpu", options=Options(gpu_mem_gb=1000.0))
    assert a.placement is pl.ON_DEVICE and not b.placement.offloads and b.placement.budget == 1000 * G
    assert a.host_staging is None and not a.host_embed
    ids = list(range(5, 17))
    assert torch.equal(a.prefill(ids), b.prefill(ids))
    a.set_position(3, 12), b.set_position(3, 12)
    a.step(), b.step()
    assert torch.equal(a.logits, b.logits)


def test_a_budget_too_small_is_refused_in_one_line(tmp_path):
    build("qwen2_moe", tmp_path)
    ck = load_checkpoint(tmp_path)
    with pytest.raises(pl.PlacementError) as e:
        GpuEngine(ck, 24, device="cpu", options=Options(gpu_mem_gb=0.5))  # under the 1 GiB margin
    assert "\n" not in str(e.value) and "--gpu-mem 0.5 GB" in str(e.value)
    with pytest.raises(UnsupportedError, match="routed experts in host RAM need 4- or 8-bit codebook"):
        GpuEngine(ck, 24, device="cpu", placement=pl.Placement(experts_host=True))  # fp16 experts


def test_gpu_mem_needs_the_gpu_engine(tmp_path):
    build("llama2", tmp_path)
    with pytest.raises(TrapetumError, match="--gpu-mem: a GPU memory budget applies to the GPU engine"):
        trapetum.load(tmp_path, gpu_mem=4)


@pytest.mark.parametrize("argv, fragment", [
    (["generate", "DIR", "hello", "--gpu-mem", "4"], "--gpu-mem: a GPU memory budget applies to the GPU engine"),
    (["generate", "DIR", "hello", "--gpu-mem", "-1"], "--gpu-mem: must be a positive number of GB"),
    (["ppl", "DIR", "--text", "DIR/config.json", "--gpu-mem", "4"], "applies to the GPU engine"),
    (["serve", "DIR", "--gpu-mem", "4"], "applies to the GPU engine"),
    (["chat", "DIR", "--gpu-mem", "x"], "--gpu-mem: expected a number of GB"),
])
def test_gpu_mem_flag_errors_are_one_line(tmp_path, capsys, argv, fragment):
    from trapetum import cli
    build("llama2", tmp_path)
    capsys.readouterr()
    code = cli.main([a.replace("DIR", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code in (1, 2) and len(err) == 1 and err[0].startswith("trapetum: error:") and fragment in err[0], err


def test_bytes_per_token_on_each_side():
    sizes = moe_sizes(embed=2000, experts=6000, rest=3000)  # 3 experts' tensors of one layer; MOE: top-2 of 4
    row = MOE.hidden_size * 2
    assert pl.per_token(sizes, MOE, pl.ON_DEVICE) == (3000 + row + 3000, 0)
    assert pl.per_token(sizes, MOE, pl.Placement(True, True)) == (3000, row + 3000)
    assert pl.per_token(sizes, MOE, pl.Placement(False, True), tied_dense_embed=True) == (5000, 3000)


def test_info_prints_the_plan(tmp_path, capsys):
    import json

    from trapetum import cli
    path = build_cbk("qwen2_moe", tmp_path, iters=1)
    capsys.readouterr()
    assert cli.main(["info", str(path), "--gpu-mem", "1.0003", "-c", "64"]) == 0
    out = capsys.readouterr().out
    assert "placement    --gpu-mem 1.0003, 64 positions: embedding and routed experts in host RAM" in out, out
    assert "per token    GPU" in out
    assert cli.main(["info", str(path), "--gpu-mem", "50", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["placement"]
    assert not p["embed_host"] and not p["experts_host"] and p["host_bytes_per_token"] == 0
    assert cli.main(["info", str(path), "--gpu-mem", "0.9"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--gpu-mem 0.9 GB" in err[0], err


@needs_host
def test_offload_benchmark_meters_the_chosen_experts():
    """eval/bench_offload.py on a tiny DeepSeek-V2-Lite-like random model on the CPU: the host meter counts k
    distinct experts' bytes per MoE layer per step (one row: its k choices are distinct)."""
    from trapetum.eval import bench_offload as bo
    from trapetum.eval.random_model import random_checkpoint
    ov = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, head_dim=48,
              kv_lora_rank=32, qk_rope_head_dim=16, v_head_dim=32, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=64)
    ck = random_checkpoint("deepseek-v2-lite", "cb4", device="cpu", layers=3, overrides=ov)
    eng = GpuEngine(ck, bo.PROMPT + 16, device="cpu", placement=pl.Placement(experts_host=True))
    meter = bo.HostMeter(eng)
    r = bo.decode(eng, 6, meter)
    per = eng.model.layers[1].mlp.experts.expert_bytes()
    assert meter.layers == 2 and meter.bytes == 6 * 2 * 2 * per  # steps x MoE layers x k x one expert's bytes
    assert r["host_mb_per_token"] == pytest.approx(2 * 2 * per / 1e6) and 0 < r["host_ms"] < r["step_ms"]
    assert sorted(meter.layer_bytes) == [1, 2] and sum(meter.layer_bytes.values()) == meter.bytes
    # (the whole benchmark at tiny widths, its table and extrapolation: tests/test_offload_shapes.py)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal; the GPU runs the benchmark")
def test_bench_offload_is_a_cli_subcommand(capsys):
    """``trapetum bench offload`` runs eval/bench_offload.py: without a GPU a one-line error and exit 1."""
    from trapetum import cli
    assert cli.main(["bench", "offload", "--layers", "1", "--steps", "1"]) == 1
    assert capsys.readouterr().err.strip() == "bench_offload: needs a CUDA GPU"
