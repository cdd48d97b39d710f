"""The batch scheduler on the GPU engine (runtime/paged_engine.py). On the CPU (the engine's torch fallbacks):
its prefill chunks and decode rows over a paged fp16 cache against the reference decoder, within the engine's
fp16 tolerance, and requests through the scheduler complete. On the GPU: 64 concurrent requests give bitwise their
alone logits and tokens (the schemes' GEMVs and the paged attention kernel are batch-invariant there; the CPU
fallbacks' matmuls are not, so that assertion needs CUDA)."""
from __future__ import annotations

import random

import pytest
import torch

import trapetum
from tests.tiny_models import build
from trapetum.runtime.paged_engine import GpuBatchRunner
from trapetum.runtime.sampling import GenerationSettings
from trapetum.runtime.scheduler import Scheduler
from trapetum.settings import Options

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.usefixtures("torch_fallbacks")


def rel(a, b):
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


@pytest.fixture(scope="module", params=["llama3", "gemma2"])
def model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    build(request.param, d, tokenizer=True)
    if ON_GPU:
        return trapetum.load(str(d), device="cuda", max_context=256)
    from trapetum.runtime.engine import GpuEngine
    m = trapetum.load(str(d))
    m.gpu_engine = GpuEngine(m.checkpoint, 256, device="cpu", options=Options())
    return m


def _engine(m):
    return m.engine if ON_GPU else m.gpu_engine


def test_paged_forwards_match_the_reference(model):
    eng = _engine(model)
    runner = GpuBatchRunner(eng, 40, 16)
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    # the reference decoder's logits on the CPU; on the GPU the engine's own one-pass prefill
    ref = eng.logits_for(ids).float().cpu() if ON_GPU else model.logits(ids)
    tables = [torch.tensor([7, 3, 30]), torch.tensor([12, 0, 25])]
    tol = 3e-3
    # sequence A: a prompt of 21 in chunks of 16 + 5, then decode rows; sequence B: a prompt of 9, then rows
    la = runner.prefill(tables[0], ids[:16], 0)
    la = runner.prefill(tables[0], ids[16:21], 16)
    lb = runner.prefill(tables[1], ids[:9], 0)
    assert rel(la, ref[20]) < tol and rel(lb, ref[8]) < tol
    for i in range(8):
        out = runner.decode(tables, [ids[21 + i], ids[9 + i]], [21 + i, 9 + i])
        assert rel(out[0], ref[21 + i]) < tol, i
        assert rel(out[1], ref[9 + i]) < tol, i
    # replay: rows 29..32 of A in one forward write the cache rows that four decode rows write
    runner.replay(tables[0], ids[29:33], 29)
    out = runner.decode(tables[:1], [ids[33]], [33])
    assert rel(out[0], ref[33]) < tol


def _requests(n, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [1] + [rng.randrange(3, 300) for _ in range((i * 7) % 37)]
        s = GenerationSettings(max_new_tokens=4 + i % 9, ignore_eos=True, stop=[["e"], []][i % 2])
        if i % 3 == 1:
            s.temperature, s.top_k, s.seed = 0.9, 40, i
        out.append((prompt, s))
    return out


def _record(sch) -> dict:
    """Every logits row each request of ``sch`` samples from, by request id; a row of an overlapped step whose
    request was already done when its token landed (its token dropped) is dropped too."""
    rows: dict = {}
    sample, land = sch._sample_rows, sch._land

    def record(reqs, logits, at=None):
        for req, i in zip(reqs, range(len(reqs)) if at is None else at):
            rows.setdefault(req.rid, []).append(logits[i].clone())
        return sample(reqs, logits, at)

    def landed(read):
        for req, _ in read.entries:
            if req.done:
                rows[req.rid].pop()
        return land(read)
    sch._sample_rows, sch._land = record, landed
    return rows


def _scheduler(model, blocks, max_batch):
    runner = GpuBatchRunner(_engine(model), blocks, 16)
    return Scheduler(runner, model.tokenizer, model.config.vocab_size, 256, max_batch=max_batch, chunk=16,
                     device=DEV)


def test_requests_complete_through_the_scheduler(model):
    reqs = _requests(6)
    sch = _scheduler(model, 12, 6)
    handles = [sch.submit(p, GenerationSettings(**{**vars(s), "stop": list(s.stop)})) for p, s in reqs]
    sch.run()
    assert all(h.done and h.completion.completion_tokens >= 1 for h in handles)
    assert sch.kv.alloc.num_free == sch.kv.num_blocks


@pytest.mark.skipif(not ON_GPU, reason="bitwise batch invariance needs the GPU kernels")
def test_64_requests_give_their_alone_tokens_on_the_gpu(model):
    reqs = _requests(64)

    def copy(s):
        return GenerationSettings(**{**vars(s), "stop": list(s.stop)})

    alone = []
    sch = _scheduler(model, 200, 64)
    for p, s in reqs:
        r = sch.submit(p, copy(s))
        sch.run()
        alone.append(r.completion)
    for blocks in (400, 60):  # room for all, then exhausted (queued and preempted)
        sch = _scheduler(model, blocks, 64)
        handles = [sch.submit(p, copy(s)) for p, s in reqs]
        sch.run()
        for i, (h, a) in enumerate(zip(handles, alone)):
            assert (h.completion.token_ids, h.completion.text) == (a.token_ids, a.text), (blocks, i)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
def test_graph_buckets_replay_the_eager_forward(model):
    """Decode rows through the captured bucket graphs (3 rows: bucket 4, one padding row; then 5: bucket 8) are
    bitwise the eager forward's, and a bucket captured once replays for other rows and positions."""
    runner = GpuBatchRunner(_engine(model), 60, 16)
    assert runner.eng.use_graph
    ids = torch.randint(3, 300, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    tables = [torch.tensor([i * 3, i * 3 + 1, i * 3 + 2]) for i in range(5)]
    for i, t in enumerate(tables):
        runner.prefill(t, ids[:5 + i], 0)
    for n, step in ((3, 0), (5, 0), (3, 1)):
        toks = [ids[20 + j + step] for j in range(n)]
        pos = [5 + j + step for j in range(n)]
        got = runner.decode(tables[:n], toks, pos)
        dev = runner.eng.device
        tab = torch.stack([runner._table(t) for t in tables[:n]]).to(dev)
        want = runner._forward(torch.tensor(toks, device=dev), torch.tensor(pos, device=dev), tab)
        assert torch.equal(got, want), (n, step)
    assert set(runner.graphs) == {(4, 1), (8, 1)}


@pytest.mark.skipif(not ON_GPU, reason="the device gather under CUDA graphs, pinned reads")
def test_overlapped_steps_give_the_sequential_tokens_and_logits_on_the_gpu(model):
    """64 requests (mixed prompts: folded; greedy and seeded; stop strings), with room for all and with blocks
    exhausted: overlapped steps (a row's pending token gathered on the device before the graph replays) give
    bitwise the sequential scheduler's tokens and logits rows."""
    reqs = _requests(64, seed=2)
    for blocks in (400, 60):
        out = {}
        for overlap in (False, True):
            runner = GpuBatchRunner(_engine(model), blocks, 16)
            sch = Scheduler(runner, model.tokenizer, model.config.vocab_size, 256, max_batch=64, chunk=16,
                            device=DEV, overlap=overlap)
            rows = _record(sch)
            hs = [sch.submit(p, GenerationSettings(**{**vars(s), "stop": list(s.stop)})) for p, s in reqs]
            sch.run()
            out[overlap] = ([(h.completion.token_ids, h.completion.text) for h in hs], rows)
        assert out[True][0] == out[False][0], blocks
        a, b = out[False][1], out[True][1]
        assert all(len(a[i]) == len(b[i]) and all(torch.equal(x, y) for x, y in zip(a[i], b[i])) for i in a), blocks


def test_staged_inputs_are_the_rows_then_padding():
    """``_stage``: tokens and positions of the S real rows, their block tables zero-padded to the width, then
    padding rows (token 0, position 0, the spare block everywhere); a bucket's buffers are reused, and rewritten
    whole (a smaller step after a larger one leaves no stale row)."""
    r = GpuBatchRunner.__new__(GpuBatchRunner)
    r.width, r.pad_block, r._host, r._staged = 6, 99, {}, None
    r.eng = type("E", (), {"device": "cpu"})()
    for S, B in ((3, 4), (1, 4), (2, 2)):
        tables = [torch.tensor([7 + i, 1, 2 * i][: i + 1]) for i in range(S)]
        toks, pos = [5 + i for i in range(S)], [10 * i for i in range(S)]
        ip, tab = r._stage(B, tables, toks, pos, reuse=True)
        assert ip.dtype == torch.long and tab.dtype == torch.int32 and tab.shape == (B, 6)
        assert ip[0].tolist() == toks + [0] * (B - S) and ip[1].tolist() == pos + [0] * (B - S)
        want = torch.stack([r._table(t) for t in tables] + [torch.full((6,), 99, dtype=torch.int32)] * (B - S))
        assert torch.equal(tab, want), (S, B)
    assert set(r._host) == {4, 2}
    ip, _ = r._stage(4, tables, toks, pos, reuse=True)
    assert ip[2].tolist() == [-1] * 4  # no pending tokens
    ip, _ = r._stage(4, tables, [0, toks[1]], pos, reuse=True, src=[3, -1])
    assert ip[2].tolist() == [3, -1, -1, -1]
    from trapetum.runtime.paged_engine import _gather
    _gather(ip, torch.tensor([40, 41, 42, 43]))  # row 0 from entry 3 of the previous step's tokens
    assert ip[0].tolist() == [43, toks[1], 0, 0]


@pytest.mark.skipif(ON_GPU, reason="the GPU runs the kernels natively (the tests above)")
def test_paged_engine_kernels_under_the_triton_interpreter(model):
    """The engine's real Triton kernels (GEMVs, norms, the paged attention; interpreted on the CPU) in the batch
    runner: three sequences decoded together against the reference, and each row bitwise its row alone."""
    from trapetum.runtime.engine import GpuEngine
    eng = GpuEngine(model.checkpoint, 64, device="cpu", options=Options())
    runner = GpuBatchRunner(eng, 12, 16)
    ids = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = model.logits(ids)
    tables = [torch.tensor([4, 1]), torch.tensor([0, 9]), torch.tensor([6, 2])]
    starts = [17, 5, 11]
    for t, n in zip(tables, starts):
        runner.prefill(t, ids[:n], 0)
    toks, pos = [ids[n] for n in starts], starts
    together = runner.decode(tables, toks, pos)
    for i, n in enumerate(starts):
        assert rel(together[i], ref[n]) < 3e-3, i
        alone = runner.decode([tables[i]], [toks[i]], [pos[i]])[0]
        assert torch.equal(alone, together[i]), i


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="the GPU runs the kernels natively (test_64_requests_give_their_alone_tokens_on_the_gpu)")
def test_scheduler_on_the_engine_under_the_triton_interpreter(model):
    """Five requests through the scheduler on the engine's interpreted Triton kernels, alone and together (then with
    few blocks: queued): the same tokens and logits bitwise."""
    from trapetum.runtime.engine import GpuEngine
    if model.config.sliding_window is not None:
        pytest.skip("one family is enough for this slow test")
    eng = GpuEngine(model.checkpoint, 64, device="cpu", options=Options())
    reqs = _requests(5)

    def run(blocks, together):
        sch = Scheduler(GpuBatchRunner(eng, blocks, 16), model.tokenizer, model.config.vocab_size, 64, max_batch=8,
                        chunk=16)
        rows = _record(sch)
        out = []
        for p, s in reqs:
            out.append(sch.submit(p, GenerationSettings(**{**vars(s), "stop": list(s.stop)})))
            if not together:
                sch.run()
        sch.run()
        return [h.completion.token_ids for h in out], rows

    alone, alone_rows = run(40, False)
    for blocks in (40, 6):
        got, rows = run(blocks, True)
        assert got == alone, blocks
        assert all(len(rows[i]) == len(alone_rows[i]) and all(torch.equal(a, b) for a, b in zip(rows[i], alone_rows[i]))
                   for i in alone_rows), blocks


@pytest.mark.skipif(ON_GPU, reason="counts the interpreter's launches (the GPU count: scripts/dev/profile_paged_step.py)")
def test_decode_launches_a_few_kernels_a_layer_under_the_triton_interpreter(model):
    """A decode forward of 3 rows launches per layer 2 RMSNorms (4 with sandwich norms), 4 GEMVs and 3 attention
    kernels (RoPE + K/V write, split, merge), nothing per row; the torch ops beside them are per step (embedding,
    lengths, the head's cast and softcap) or, with sandwich norms, the 2 residual adds a layer."""
    import triton.runtime.interpreter as interp
    from torch.utils._python_dispatch import TorchDispatchMode
    from trapetum.runtime.engine import GpuEngine
    eng = GpuEngine(model.checkpoint, 64, device="cpu", options=Options())
    runner = GpuBatchRunner(eng, 12, 16)
    tables = [torch.tensor([4, 1]), torch.tensor([0, 9]), torch.tensor([6, 2])]
    for t, n in zip(tables, (17, 5, 11)):
        runner.prefill(t, list(range(3, 3 + n)), 0)
    depth, launches, ops = [0], {}, {}
    run = interp.InterpretedFunction.run

    def counted(self, *a, **k):
        launches[self.fn.__name__] = launches.get(self.fn.__name__, 0) + 1
        depth[0] += 1
        try:
            return run(self, *a, **k)
        finally:
            depth[0] -= 1

    free = {"view", "slice", "as_strided", "detach", "alias", "_unsafe_view", "select", "unsqueeze", "t",
            "transpose", "expand", "lift_fresh"}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if depth[0] or name in free or name.startswith(("empty", "resolve")):
                return out
            if isinstance(out, torch.Tensor) and any(isinstance(a, torch.Tensor) and a.data_ptr() == out.data_ptr()
                                                     and a.dtype == out.dtype for a in args):
                return out  # a no-op (a cast to its own dtype, a view)
            ops[name] = ops.get(name, 0) + 1
            return out

    interp.InterpretedFunction.run = counted
    try:
        with Count():
            runner.decode(tables, [5, 6, 7], [17, 5, 11])
    finally:
        interp.InterpretedFunction.run = run
    cfg = model.config
    L, sandwich = cfg.num_layers, cfg.sandwich_norms
    norms = 4 if sandwich else 2
    assert launches["_rmsnorm_kernel"] == norms * L + 1, launches
    assert (launches["_paged_rope_kv"], launches["_paged_split"], launches["_paged_merge"]) == (L, L, L), launches
    gemvs = sum(n for k, n in launches.items() if k not in ("_rmsnorm_kernel", "_paged_rope_kv", "_paged_split",
                                                           "_paged_merge"))
    assert gemvs == 4 * L + 1, launches
    per_step = sum(ops.values()) - (2 * L if sandwich else 0)
    assert per_step <= 8, ops
    if sandwich:
        assert ops.get("add", 0) >= 2 * L, ops


def test_chunk_bound_is_a_power_of_two_over_the_longest_row():
    """``chunk_bound``: the split grid's chunks (64 positions at block size 16) for a step's longest row, rounded
    up to a power of two (few graphs per bucket), at most the table's."""
    r = GpuBatchRunner.__new__(GpuBatchRunner)
    r.kv, r.width = type("K", (), {"block_size": 16})(), 64
    got = [r.chunk_bound(n) for n in (1, 64, 65, 128, 129, 193, 257, 1024, 5000)]
    assert got == [1, 1, 2, 2, 4, 4, 8, 16, 16]


@pytest.mark.skipif(not ON_GPU, reason="the padded prefill graphs and pinned uploads are CUDA's")
def test_prefill_writes_every_layer_at_once_as_the_per_layer_copies(model):
    """``prefill`` (every layer's rows in one launch for K and one for V, the table and tokens through pinned
    buffers) leaves in the blocks, and returns, bitwise what the per-layer copies around the engine's pass did;
    prompts of 33..48 tokens share the bucket-48 prefill graph (captured at the second use, replayed after, the
    eager first use's bits), and a later chunk (start > 0) gathers its prefix back exactly."""
    from trapetum.runtime.engine import GpuEngine
    from trapetum.runtime.paged_kv import PagedKV
    eng = GpuEngine(model.checkpoint, 256, device="cuda", options=Options())
    runner = GpuBatchRunner(eng, 20, 16)
    old = PagedKV(model.config, 20, 16, torch.float16, "cuda", spare_blocks=1)
    ids = torch.randint(3, 300, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    table = torch.tensor([9, 2, 14, 5])
    first = {}
    for T in (38, 45, 47, 33, 40, 38):
        got = runner.prefill(table, ids[:T], 0)
        want = eng.prefill(torch.tensor(ids[:T], device="cuda"))  # the same engine pass, then per-layer copies
        for layer in range(model.config.num_layers):
            old.write(layer, table.cuda(), 0, eng.kv.k[layer, :, :T], eng.kv.v[layer, :, :T])
        assert torch.equal(got, want.float()), T
        for layer in range(model.config.num_layers):
            kb, ko = runner.kv.gather(layer, table.cuda(), T), old.gather(layer, table.cuda(), T)
            assert torch.equal(kb[0], ko[0]) and torch.equal(kb[1], ko[1]), (T, layer)
        first.setdefault(T, got)
        assert torch.equal(got, first[T]), T  # eager first use == graph replay
    if eng._pads_prefill(40):
        assert set(eng.prefill_graphs) == {48}
    fresh = GpuEngine(model.checkpoint, 256, device="cuda", options=Options())  # its first use of 48: eager
    assert torch.equal(fresh.prefill(torch.tensor(ids[:40], device="cuda")), first[40])
    # a second chunk: the prefix of every layer gathered into the engine's cache in one copy
    runner.prefill(table, ids[:16], 0)
    eng.kv.k.zero_(), eng.kv.v.zero_()
    got = runner.prefill(table, ids[16:40], 16)
    ks, vs = eng.kv.k[:, :, :40].clone(), eng.kv.v[:, :, :40].clone()
    eng.kv.k.zero_(), eng.kv.v.zero_()
    for layer in range(model.config.num_layers):
        k, v = runner.kv.gather(layer, table.cuda(), 16)
        eng.kv.k[layer, :, :16], eng.kv.v[layer, :, :16] = k, v
    want = runner._chunk(torch.tensor(ids[16:40], device="cuda"), 16)[-1].float()
    assert torch.equal(got, want)
    assert torch.equal(ks, eng.kv.k[:, :, :40]) and torch.equal(vs, eng.kv.v[:, :, :40])


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
def test_folded_prompt_rows_through_bucket_48_replay_the_eager_forward(model):
    """40 rows of one sequence at positions 0..39 (a folded prompt) through the bucket-48 graph: bitwise the eager
    forward, captured once and replayed; and the scheduler's folded prompts, one row a step alone against 64 rows
    a step beside other requests: the same tokens and logits."""
    runner = GpuBatchRunner(_engine(model), 20, 16)
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    table = torch.tensor([4, 11, 0])
    for _ in range(2):
        got = runner.decode([table] * 40, ids, list(range(40)))
        dev = runner.eng.device
        tab = torch.stack([runner._table(table)] * 40).to(dev)
        want = runner._forward(torch.tensor(ids, device=dev), torch.arange(40, device=dev), tab)
        assert torch.equal(got, want)
    assert (48, 1) in runner.graphs
    reqs = _requests(12, seed=4)

    def run(budget, together):
        sch = Scheduler(GpuBatchRunner(_engine(model), 120, 16), model.tokenizer, model.config.vocab_size, 256,
                        max_batch=12, chunk=16, prefill_budget=budget, fold=256, device=DEV)
        rows = _record(sch)
        out = []
        for p, s in reqs:
            out.append(sch.submit(p, GenerationSettings(**{**vars(s), "stop": list(s.stop)})))
            if not together:
                sch.run()
        sch.run()
        return [h.completion.token_ids for h in out], rows
    alone, alone_rows = run(1, False)
    got, rows = run(64, True)
    assert got == alone
    assert all(len(rows[i]) == len(alone_rows[i]) and all(torch.equal(a, b) for a, b in zip(rows[i], alone_rows[i]))
               for i in alone_rows)
