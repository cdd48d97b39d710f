"""The CPU decode step's executor (models/cpu_ops.py) on tiny random models of every dense family, quantized
(4-bit projections, 8-bit head): decode steps and short prompts against the float64 reference decoder (within
1e-4 relative), greedy tokens identical to the reference decoder's own fp32 host path, VERIFY rows bitwise the
decode steps, the same bits for every thread count, passes it does not take left to the reference ops."""
from __future__ import annotations

import pytest
import torch

import trapetum
from tiny_models import FAMILIES, ROPE_FAMILIES, build_cbk
from trapetum.formats.detect import load_checkpoint
from trapetum.kernels import host_gemv as hg
from trapetum.models.batch import Mode
from trapetum.models.decoder import Decoder
from trapetum.settings import Options

if not hg.available():
    pytest.skip(f"host kernels unavailable: {hg.error()}", allow_module_level=True)

PROMPT = [1, 5, 9, 14, 3, 22]
STEPS = [7, 30, 11, 4, 18, 25, 6, 13, 40, 2, 9, 17, 21, 8]  # 20 positions in all: past the sliding windows (8)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


FAST = ("llama2", "qwen2", "gemma2")  # plain, q/k/v biases + tied head, softcaps + sliding windows + sandwich norms
PARAMS = [f if f in FAST else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES + ROPE_FAMILIES]


@pytest.fixture(scope="module", params=PARAMS)
def family(request, tmp_path_factory):
    path = build_cbk(request.param, tmp_path_factory.mktemp(request.param))
    ref = Decoder.from_checkpoint(load_checkpoint(str(path)), dtype=torch.float64).eval()
    return request.param, path, ref


def _steps(dec):
    """Logits [T, V] of the prompt pass then one decode step per STEPS token, over a fresh cache."""
    cache = dec.new_cache(1, 64)
    with torch.inference_mode():
        rows = [dec(torch.tensor([PROMPT]), cache, 0)[0]]
        for i, t in enumerate(STEPS):
            rows.append(dec(torch.tensor([[t]]), cache, len(PROMPT) + i)[0])
    return torch.cat(rows)


def test_steps_match_the_float64_reference(family):
    name, path, ref = family
    m = trapetum.load(path)
    dec = m.decoder
    assert dec.cpu_step is not None and dec.cpu_step.dense
    got = _steps(dec)
    assert dec.cpu_step._plan is not None  # the passes ran on the CPU executor
    with torch.inference_mode():
        want = ref(torch.tensor([PROMPT + STEPS]))[0]
    assert _rel(got, want) < 1e-4, name
    for p in range(got.shape[0]):
        assert _rel(got[p], want[p]) < 1e-4, (name, p)


def test_greedy_tokens_equal_the_reference_decoders(family):
    name, path, ref = family
    new = trapetum.load(path).generate(PROMPT, max_new_tokens=12, ignore_eos=True).token_ids
    old = trapetum.load(path, options=Options(cpu_step=False)).generate(PROMPT, max_new_tokens=12,
                                                                         ignore_eos=True).token_ids
    assert new == old, name
    with torch.inference_mode():
        logits = ref(torch.tensor([PROMPT + new]))[0]
    for i, t in enumerate(new):  # each the float64 argmax, up to a near tie
        row = logits[len(PROMPT) - 1 + i]
        assert row[t] >= row.max() - 1e-4 * row.abs().max(), (name, i)


def test_verify_rows_are_bitwise_the_decode_steps_for_every_thread_count(family):
    name, path, _ = family
    base = None
    for threads in (1, 2, 3):
        dec = trapetum.load(path, threads=threads).decoder
        with torch.inference_mode():
            c1, c2 = dec.new_cache(1, 64), dec.new_cache(1, 64)
            dec(torch.tensor([PROMPT]), c1, 0)
            dec(torch.tensor([PROMPT]), c2, 0)
            rows = dec(torch.tensor([STEPS[:9]]), c1, len(PROMPT), mode=Mode.VERIFY)[0]
            steps = torch.cat([dec(torch.tensor([[t]]), c2, len(PROMPT) + i)[0] for i, t in enumerate(STEPS[:9])])
        assert torch.equal(rows, steps), (name, threads)
        assert torch.equal(c1.k[0][:, :, :15], c2.k[0][:, :, :15])
        if base is None:
            base = rows
        assert torch.equal(rows, base), (name, threads)


def test_whole_layer_calls_are_bitwise_the_ops_one_by_one(family, monkeypatch):
    """CpuStep runs each plain dense layer in one C call (ho.DenseLayer); forcing every layer through the blocks
    (one op at a time) gives the same bits, at each thread count; the families with q/k or sandwich norms keep
    the blocks."""
    from trapetum.kernels import host_ops as ho
    from trapetum.models.cpu_ops import CpuStep
    name, path, _ = family
    calls, run = [], ho.DenseLayer.__call__
    monkeypatch.setattr(ho.DenseLayer, "__call__", lambda self, *a: calls.append(1) or run(self, *a))
    for threads in (1, 2):
        dec = trapetum.load(path, threads=threads).decoder
        del calls[:]
        got = _steps(dec)
        taken = dec.cpu_step._layers
        cfg = dec.config
        plain = not (cfg.qk_norm or cfg.sandwich_norms) and all(
            cfg.block_kinds(i) == ("attention", "mlp") for i in range(cfg.num_layers))
        assert taken is not None and all(taken) == plain and any(taken) == plain, name
        assert len(calls) == (cfg.num_layers * (1 + len(STEPS)) if plain else 0), name
        with monkeypatch.context() as mp:
            mp.setattr(CpuStep, "dense_layer", lambda self, layer: None)
            want = _steps(trapetum.load(path, threads=threads).decoder)
        assert torch.equal(got, want), (name, threads)


def test_other_passes_keep_the_reference_ops(family):
    name, path, _ = family
    dec = trapetum.load(path).decoder
    step = dec.cpu_step
    assert not step.applies(torch.zeros(2, 3, dtype=torch.long), dec.new_cache(2, 8))  # two sequences
    assert not step.applies(torch.zeros(1, 17, dtype=torch.long), dec.new_cache(1, 32))  # a long prompt
    assert not step.applies(torch.zeros(1, 1, dtype=torch.long), None)  # no cache
    assert not step.applies(torch.zeros(1, 1, dtype=torch.long), dec.new_cache(1, 8).__class__(
        dec.config, 1, 8, torch.float64))  # a float64 cache
    off = trapetum.load(path, options=Options(cpu_step=False)).decoder
    assert off.cpu_step is None


def test_activation_sparsity_on_the_step_executor_matches_the_reference_ops(family):
    """The step executor thresholds like TorchOps (models/sparsity.py): position 0 dense, |x| <= t zeroed; its
    logits agree with the reference ops' under the same table, and differ from the dense ones (the table bites)."""
    from trapetum.models.sparsity import SiteThresholds, SparsityTable
    name, path, _ = family
    n = load_checkpoint(str(path)).config.num_layers
    table = SparsityTable(tuple(SiteThresholds(qkv=0.3, o=0.05, gate_up=0.3, down=0.05) for _ in range(n)))
    step = trapetum.load(path).decoder
    ops = trapetum.load(path, options=Options(cpu_step=False)).decoder
    dense = _steps(step)
    step.set_sparsity(table)
    ops.set_sparsity(table)
    got, want = _steps(step), _steps(ops)
    assert step.cpu_step._plan is not None  # the sparse passes ran on the CPU executor
    assert _rel(got, want) < 1e-3, name
    assert _rel(got, dense) > 1e-3, name
    assert torch.equal(got[0], dense[0])  # position 0 stays dense (its logits row sees only itself)
