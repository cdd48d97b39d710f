"""The batch scheduler over the paged KV cache on the CPU backends (runtime/scheduler.py, paged_kv.py,
paged_ops.py): the allocator's accounting, the paged forwards against the contiguous-cache reference decoder
(within fp32 rounding), the row-independence of the kernels the decode forward uses, and batch invariance:
64 concurrent requests (mixed prompt lengths, greedy and seeded sampling, stop strings) give exactly the tokens
each gives alone, also with requests cancelled mid-way and with KV blocks exhausted (queued, or refused with
KVExhausted), on the reference TorchOps path (fp32 HF model) and on the host-kernel CPU executor (.cbk); and the
overlapped steps (``Scheduler(overlap=True)``: step N + 1 enqueued before step N's tokens are read, a row's input
token taken on the device) give exactly the sequential scheduler's tokens, logits and events."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tiny_models import build
from trapetum.errors import TrapetumError
from trapetum.formats.detect import load_checkpoint
from trapetum.kernels import host_gemv as hg
from trapetum.models.decoder import Decoder
from trapetum.runtime import paged_kv
from trapetum.runtime.paged_kv import BlockAllocator, KVExhausted, PagedKV
from trapetum.runtime.paged_ops import CpuBatchRunner
from trapetum.runtime.sampling import GenerationSettings
from trapetum.runtime.scheduler import Scheduler, drain

pytestmark = pytest.mark.usefixtures("one_thread")
CTX = 256


def _model(path, host: bool):
    ck = load_checkpoint(str(path))
    dec = Decoder.from_checkpoint(ck).eval()
    if host:
        assert dec.use_host_kernels(1) > 0
        assert dec.cpu_step is not None and dec.cpu_step.dense
    return ck, dec


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama3")
    build("llama3", d, tokenizer=True)
    return _model(d, host=False)


@pytest.fixture(scope="module")
def cbk_model(tmp_path_factory):
    if not hg.available():
        pytest.skip(f"host kernels unavailable: {hg.error()}")
    from trapetum.quant.quantize import Recipe, quantize_to_cbk
    d = tmp_path_factory.mktemp("gemma2")
    build("gemma2", d / "src", tokenizer=True)  # sliding windows, softcaps, sandwich norms
    out = Path(d) / "m.cbk"
    quantize_to_cbk(str(d / "src"), out, Recipe(bits=4, head_bits=8, weighted=False, iters=3).validate(),
                    progress=False, log=lambda s: None)
    return _model(out, host=True)


class Recording(Scheduler):
    """A scheduler that keeps every logits row each request sampled from (by request id: the order of submits)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.rows: dict[int, list[torch.Tensor]] = {}

    def _sample_rows(self, reqs, logits, at=None):
        for req, i in zip(reqs, range(len(reqs)) if at is None else at):
            assert req.sampled < req.settings.max_new_tokens, req.rid  # no row past max_new_tokens
            self.rows.setdefault(req.rid, []).append(logits[i].clone())
        return super()._sample_rows(reqs, logits, at)

    def _land(self, read):
        for req, _ in read.entries:  # an overlapped row of a request already done: its token is dropped, and
            if req.done:             # the row was its last one sampled
                self.rows[req.rid].pop()
        return super()._land(read)

    def _preempt(self, req):
        self.preempted_pending = getattr(self, "preempted_pending", 0) + (req.pending is not None)
        return super()._preempt(req)


def _scheduler(model, blocks=400, block_size=4, **kw):
    ck, dec = model
    kv = PagedKV(ck.config, blocks, block_size, poison_freed=True)
    return Recording(CpuBatchRunner(dec, kv), ck.tokenizer, ck.config.vocab_size, CTX, **kw)


# -- the allocator and the cache ---------------------------------------------------------------
def test_allocator_accounting():
    a = BlockAllocator(5)
    assert a.allocate(2) == [0, 1] and a.num_free == 3 and a.used == 2
    b = a.allocate(3)
    assert b == [2, 3, 4] and a.num_free == 0 and a.peak == 5
    with pytest.raises(KVExhausted, match="needs 1 blocks, 0 of 5 are free"):
        a.allocate(1)
    a.free([3, 0])
    assert a.num_free == 2 and a.allocate(2) == [0, 3]
    a.free([0])
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free([0])
    with pytest.raises(TrapetumError):
        BlockAllocator(0)


def test_paged_write_gather_roundtrip(hf_model):
    cfg = hf_model[0].config
    kv = PagedKV(cfg, 12, 3)
    table = torch.tensor([7, 2, 9, 0, 5])
    k = torch.randn(cfg.num_kv_heads, 14, cfg.head_dim)
    v = torch.randn_like(k)
    kv.write(1, table, 0, k[:, :5], v[:, :5])
    kv.write(1, table, 5, k[:, 5:], v[:, 5:])
    gk, gv = kv.gather(1, table, 14)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    assert torch.equal(kv.k[1][2, :, 1], k[:, 4])  # position 4: block table[1] = 2, offset 1
    with pytest.raises(RuntimeError, match="past the sequence"):
        kv.write(0, table, 14, k[:, :2], v[:, :2])


@pytest.mark.parametrize("start,n", [(0, 1), (0, 14), (5, 9), (3, 1), (13, 2)])
def test_all_layer_write_and_gather_are_each_layers(hf_model, start, n, monkeypatch):
    """``write_all`` / ``gather_all`` (one launch each for K and V over every layer) leave and read the values
    that ``write`` / ``gather`` of each layer do; the layer views share the one tensor."""
    cfg = hf_model[0].config
    L, H, hd = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    a, b = PagedKV(cfg, 12, 3, poison_freed=True), PagedKV(cfg, 12, 3, poison_freed=True)
    assert a.k[1].data_ptr() == a.K[1].data_ptr() and a.v[L - 1].data_ptr() == a.V[L - 1].data_ptr()
    table = torch.tensor([7, 2, 9, 0, 5])
    k, v = torch.randn(L, H, n, hd), torch.randn(L, H, n, hd)
    a.write_all(table, start, k, v)
    for layer in range(L):
        b.write(layer, table, start, k[layer], v[layer])
    assert torch.equal(a.K.nan_to_num(7.0), b.K.nan_to_num(7.0)) and torch.equal(a.V.nan_to_num(7.0), b.V.nan_to_num(7.0))
    length = start + n
    gk, gv = torch.zeros(L, H, length + 3, hd), torch.zeros(L, H, length + 3, hd)
    a.gather_all(table, length, gk, gv)
    sk, sv = torch.zeros_like(gk), torch.zeros_like(gv)
    monkeypatch.setattr(paged_kv, "GATHER_BYTES", 1)  # one layer a slice
    a.gather_all(table, length, sk, sv)
    assert torch.equal(sk.nan_to_num(7.0), gk.nan_to_num(7.0)) and torch.equal(sv.nan_to_num(7.0), gv.nan_to_num(7.0))
    for layer in range(L):
        wk, wv = b.gather(layer, table, length)
        assert torch.equal(gk[layer, :, :length].nan_to_num(7.0), wk.nan_to_num(7.0))
        assert torch.equal(gv[layer, :, :length].nan_to_num(7.0), wv.nan_to_num(7.0))
    assert not gk[:, :, length:].any()
    with pytest.raises(RuntimeError, match="past the sequence"):
        a.write_all(table, 14, k[:, :, :1].expand(L, H, 2, hd), v[:, :, :1].expand(L, H, 2, hd))


# -- the kernels of the decode forward: each row's result independent of the other rows ----------
@pytest.mark.parametrize("m", [1, 3, 17, 53, 64])
def test_host_gemv_rows_are_batch_invariant(cbk_model, m):
    dec = cbk_model[1]
    step = dec.cpu_step
    step._plan = None
    from trapetum.models.cpu_ops import _Plan
    plan = _Plan(dec)
    attn = dict(plan.layers[0].blocks)["attention"]
    f = step.fused(attn.qkv)
    assert f
    x = torch.randn(m, f.in_features)
    rows = f.run(x, torch.empty(m, f.out_features), None, 1)
    for i in range(m):
        one = f.run(x[i:i + 1].clone(), torch.empty(1, f.out_features), None, 1)
        assert torch.equal(rows[i:i + 1], one)


@pytest.mark.parametrize("which", ["hf", "cbk"])
def test_decode_rows_independent_of_the_batch(which, hf_model, cbk_model):
    """One decode forward over S sequences: each sequence's logits bitwise its forward alone."""
    model = hf_model if which == "hf" else cbk_model
    sch = _scheduler(model)
    runner = sch.runner
    rng = random.Random(3)
    seqs = []
    for i in range(9):
        n = 1 + 5 * i
        blocks = runner.kv.alloc.allocate(runner.kv.blocks_needed(n + 1))
        table = torch.tensor(blocks)
        runner.prefill(table, [rng.randrange(3, 300) for _ in range(n)], 0)
        seqs.append((table, rng.randrange(3, 300), n))
    together = runner.decode([t for t, _, _ in seqs], [x for _, x, _ in seqs], [p for _, _, p in seqs])
    for i, (t, x, p) in enumerate(seqs):
        alone = runner.decode([t], [x], [p])[0]
        assert torch.equal(together[i], alone), i


@pytest.mark.parametrize("which", ["hf", "cbk"])
def test_paged_forwards_match_the_contiguous_reference(which, hf_model, cbk_model):
    """Prefill in chunks, then decode steps over scattered blocks, against the reference decoder over its
    contiguous cache (one prefill, decode steps): logits within fp32 rounding."""
    ck, dec = hf_model if which == "hf" else cbk_model
    kv = PagedKV(ck.config, 40, 3)
    runner = CpuBatchRunner(dec, kv)
    prompt, steps = [1, 5, 9, 14, 3, 22, 40, 41, 42, 43, 44, 45, 46], [7, 30, 11, 4, 18, 25, 6, 13]
    table = torch.tensor([31, 2, 17, 5, 0, 22, 9, 38])  # 24 positions
    ref_cache = dec.new_cache(1, 64)
    with torch.inference_mode():
        ref = [dec(torch.tensor([prompt]), ref_cache, 0)[0, -1]]
        for i, t in enumerate(steps):
            ref.append(dec(torch.tensor([[t]]), ref_cache, len(prompt) + i)[0, -1])
    got = [runner.prefill(table, prompt[:8], 0), runner.prefill(table, prompt[8:], 8)][1:]
    for i, t in enumerate(steps):
        got.append(runner.decode([table], [t], [len(prompt) + i])[0])
    for a, b in zip(got, ref):
        assert float((a.double() - b.double()).norm() / b.double().norm()) < 1e-5


# -- batch invariance ----------------------------------------------------------------------------
def _requests(n=64, seed=0):
    """Mixed prompt lengths and sampling; no stop strings yet (``_with_stops`` adds them)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [1] + [rng.randrange(3, 300) for _ in range((i * 7) % 37)]
        kind = i % 4
        s = GenerationSettings(max_new_tokens=6 + i % 11, ignore_eos=i % 5 == 0)
        if kind == 1:
            s.temperature, s.top_k, s.seed = 0.9, 40, i
        elif kind == 2:
            s.temperature, s.top_p, s.min_p, s.repetition_penalty, s.seed = 0.7, 0.9, 0.05, 1.2, 1000 + i
        elif kind == 3:
            s.repetition_penalty = 1.3
        out.append((prompt, s))
    return out


def _stops_from(tokenizer, probe, i: int) -> list[str]:
    """Stop strings that occur in the request's own output (``probe``: its completion alone, without stops),
    whatever the random weights are: every third request none, the others one or two windows of the text of all
    but its last token (so that a stop completes before max_new_tokens), avoiding partial UTF-8 characters."""
    if i % 3 == 2 or len(probe.token_ids) < 2:
        return []
    t = tokenizer.decode(probe.token_ids[:-1])

    def window(at: int, n: int) -> list[str]:
        for a in range(at, len(t) - n + 1):
            w = t[a:a + n]
            if "\ufffd" not in w and w in probe.text:
                return [w]
        return []
    if len(t) < 3:
        return []
    if i % 3 == 0:
        return window(len(t) // 2, 1)
    return window(2 * len(t) // 3, 2) + window(len(t) // 3, 1)  # two stops: the first to occur wins


def _copy(s: GenerationSettings) -> GenerationSettings:
    return GenerationSettings(**{**vars(s), "stop": list(s.stop)})


def _run_alone(model, reqs):
    sch = _scheduler(model, chunk=8)
    out = []
    for prompt, s in reqs:
        r = sch.submit(prompt, _copy(s))
        sch.run()
        out.append(r.completion)
    assert sch.kv.alloc.num_free == sch.kv.num_blocks
    return out, sch.rows


def _alone(model):
    """The requests with stop strings taken from each one's own output (a probe run alone without stops), and
    their completions and logits alone. Asserts the stop handling: a request with stops ends on the first one
    to occur in its probe's text, its text cut just before it, its tokens a prefix of the probe's."""
    reqs = _requests()
    probes, _ = _run_alone(model, reqs)
    tok = model[0].tokenizer
    reqs = [(p, GenerationSettings(**{**vars(s), "stop": _stops_from(tok, c, i)}))
            for i, ((p, s), c) in enumerate(zip(reqs, probes))]
    ref, rows = _run_alone(model, reqs)
    for i, ((_, s), c, probe) in enumerate(zip(reqs, ref, probes)):
        if s.stop:
            cut = min(k for k in (probe.text.find(w) for w in s.stop) if k >= 0)
            assert (c.finish_reason, c.text) == ("stop", probe.text[:cut]), i
            assert c.token_ids == probe.token_ids[:len(c.token_ids)] and len(c.token_ids) < len(probe.token_ids), i
        else:
            assert (c.token_ids, c.text, c.finish_reason) == (probe.token_ids, probe.text, probe.finish_reason), i
    assert sum(bool(s.stop) for _, s in reqs) >= 30  # stop strings end requests whatever the weights
    return reqs, ref, rows


@pytest.fixture(scope="module")
def alone(hf_model, cbk_model):
    return {"hf": _alone(hf_model), "cbk": _alone(cbk_model)}


def _same(a, b):
    return (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)


def _same_rows(a: list, b: list) -> bool:
    return len(a) <= len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("which", ["hf", "cbk"])
def test_64_concurrent_requests_give_their_alone_tokens(which, overlap, hf_model, cbk_model, alone):
    reqs, ref, ref_rows = alone[which]
    assert sum(c.finish_reason == "stop" for c in ref) >= 30  # stop strings end requests (``_alone``)
    sch = _scheduler(hf_model if which == "hf" else cbk_model, max_batch=64, chunk=8, prefill_budget=160,
                     overlap=overlap)
    handles = [sch.submit(p, _copy(s)) for p, s in reqs]
    sch.run()
    assert sch.peak_batch >= 24  # decoded together, not one by one
    for i, (h, c) in enumerate(zip(handles, ref)):
        assert _same(h.completion, c), i
        assert len(sch.rows[i]) == len(ref_rows[i]) and _same_rows(sch.rows[i], ref_rows[i]), i  # logits bitwise
    assert sch.kv.alloc.num_free == sch.kv.num_blocks


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("which", ["hf", "cbk"])
@pytest.mark.parametrize("blocks", [100, 40])
def test_cancelled_and_exhausted_blocks_leave_the_others_exact(which, blocks, overlap, hf_model, cbk_model, alone):
    """Few blocks (the rest queue; running requests are preempted and rebuilt), freed blocks poisoned
    with NaN and reused, every seventh request cancelled after its third token: the others give their alone
    tokens and logits, the cancelled ones a prefix of theirs."""
    reqs, ref, ref_rows = alone[which]
    sch = _scheduler(hf_model if which == "hf" else cbk_model, blocks=blocks, max_batch=64, chunk=8,
                     overlap=overlap)
    handles = [sch.submit(p, _copy(s)) for p, s in reqs]
    cancel = {i for i in range(0, 64, 7)}
    cancelled = set()
    most = queued = 0
    while sch.has_work:
        most, queued = max(most, len(sch.active)), max(queued, len(sch.waiting))
        assert sch.kv.alloc.used == sum(len(r.blocks) for r in sch.active)
        for r in sch.step():
            if r.rid in cancel and not r.done and len(r.stream.out) >= 3:
                sch.cancel(r)
                cancelled.add(r.rid)
    print(f"{which} {blocks} blocks: at most {most} running, {queued} queued, {sch.preemptions} preemptions")
    assert most < 40 and queued > 20  # blocks ran out: requests waited
    assert sch.preemptions > 0  # running requests were preempted and rebuilt
    assert len(cancelled) >= 5
    for i, (h, c) in enumerate(zip(handles, ref)):
        if i in cancelled:
            assert h.completion.finish_reason == "cancelled"
            assert h.completion.token_ids == c.token_ids[:len(h.completion.token_ids)]
        else:
            assert _same(h.completion, c), i
        assert _same_rows(sch.rows[i], ref_rows[i]), i
    assert sch.kv.alloc.num_free == sch.kv.num_blocks


def test_reject_when_full_and_too_long(hf_model):
    sch = _scheduler(hf_model, blocks=6, block_size=4, on_full="reject")
    with pytest.raises(TrapetumError, match="more than the whole cache of 6"):
        sch.submit([1] * 20, GenerationSettings(max_new_tokens=8))
    a = sch.submit([1] * 13, GenerationSettings(max_new_tokens=4, ignore_eos=True))  # 13 positions: 4 blocks
    sch.step()
    assert sch.kv.alloc.num_free == 2
    with pytest.raises(KVExhausted, match="needs 3 blocks, 2 of 6 are free"):  # its prompt's 2 and a spare
        sch.submit([1] * 5, GenerationSettings(max_new_tokens=9))
    sch.cancel(a)  # frees at once
    assert sch.kv.alloc.num_free == 6 and a.completion.finish_reason == "cancelled"
    b = sch.submit([1, 2, 3], GenerationSettings(max_new_tokens=9))
    sch.run()
    assert b.completion.finish_reason in ("length", "stop") and sch.load()["free_blocks"] == 6


def test_cancel_waiting_and_zero_new_tokens(hf_model):
    sch = _scheduler(hf_model, blocks=4, block_size=4, max_batch=1)
    a = sch.submit([1, 2, 3], GenerationSettings(max_new_tokens=4, ignore_eos=True))
    b = sch.submit([1, 2, 3], GenerationSettings(max_new_tokens=4))
    z = sch.submit([1, 2], GenerationSettings(max_new_tokens=0))
    assert z.done and z.completion.finish_reason == "length" and z.completion.token_ids == []
    sch.step()
    assert sch.load() == {"running": 1, "queued": 1, "free_blocks": 3, "total_blocks": 4, "max_batch": 1,
                          "preemptions": 0}
    sch.cancel(b)
    assert b.done and b.completion.finish_reason == "cancelled" and not sch.waiting
    sch.run()
    assert a.completion.finish_reason in ("length", "stop")


def test_sample_rows_one_argmax_is_each_rows_own_sampler(hf_model):
    """``_sample_rows``: the plain greedy rows' tokens from one argmax over their rows equal what each row's own
    sampler gives alone (ties: the first maximum), with sampled and penalized greedy rows mixed in; and the
    one-prefill-forward-per-step budget (a short prompt's forward counts as a chunk)."""
    sch = _scheduler(hf_model, blocks=40, block_size=4, max_batch=8, chunk=8)
    kinds = [dict(), dict(temperature=0.8, seed=3), dict(repetition_penalty=1.3), dict(), dict(top_k=5,
             temperature=1.1, seed=9), dict()]
    V = 64
    for mix in (kinds, [dict()] * 4, kinds[1:3]):
        reqs = [sch.submit([1, 2, 3], GenerationSettings(max_new_tokens=4, **k)) for k in mix]
        for r in reqs:
            sch.cancel(r)
        g = torch.Generator().manual_seed(len(mix))
        logits = torch.randint(0, 6, (len(mix), V), generator=g).float()  # many tied maxima
        from trapetum.runtime.sampling import Sampler
        for r, k in zip(reqs, mix):
            r.sampler = Sampler(r.settings, V, "cpu", r.prompt)
        got = sch._sample_rows(reqs, logits)
        for r, k in zip(reqs, mix):  # fresh samplers of the same settings, row by row
            r.sampler = Sampler(r.settings, V, "cpu", r.prompt)
        want = torch.cat([r.sampler(row) for r, row in zip(reqs, logits)])
        assert torch.equal(got, want), mix
        assert all(int(got[i]) == int(torch.argmax(logits[i])) for i, k in enumerate(mix) if not k)
    sch = _scheduler(hf_model, blocks=40, block_size=4, max_batch=8, chunk=8)
    reqs = [sch.submit([1, 2, 3], GenerationSettings(max_new_tokens=4, ignore_eos=True)) for _ in range(3)]
    sch.step()
    assert [r.state for r in reqs] == ["decode", "prefill", "prefill"]  # 3 positions, counted as a chunk of 8
    sch.run()
    assert all(r.completion.finish_reason == "length" for r in reqs)
    # rows picked by ``at`` out of more logits rows (a folded prompt's last row): the same tokens
    reqs = [sch.submit([1, 2, 3], GenerationSettings(max_new_tokens=4, **k)) for k in kinds]
    for r in reqs:
        sch.cancel(r)
        r.sampler = Sampler(r.settings, V, "cpu", r.prompt)
    logits = torch.randint(0, 6, (2 * len(kinds) + 1, V), generator=torch.Generator().manual_seed(7)).float()
    at = [2 * i + 1 for i in range(len(kinds))]
    got = sch._sample_rows(reqs, logits.clone(), at)
    for r in reqs:
        r.sampler = Sampler(r.settings, V, "cpu", r.prompt)
    want = torch.cat([r.sampler(logits[i].clone()) for r, i in zip(reqs, at)])
    assert torch.equal(got[at], want)


# -- folded prompts: prompt positions as decode rows --------------------------------------------------
FOLD = 20  # prompts of at most 20 tokens fold (the others take the prefill forward): mixed in each run


def _fold_alone(model, reqs):
    """Each request alone, its folded prompt one row a step (prefill_budget 1: the prompt decoded token by token)."""
    out, rows = [], {}
    for j, (p, s) in enumerate(reqs):
        sch = _scheduler(model, chunk=8, fold=FOLD, prefill_budget=1)
        r = sch.submit(p, _copy(s))
        sch.run()
        out.append(r.completion)
        rows[j] = sch.rows[0]
    return out, rows


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("which", ["hf", "cbk"])
def test_folded_prompts_are_exact_in_any_batch_cancelled_or_exhausted(which, overlap, hf_model, cbk_model):
    """24 requests, prompts of 1..37 tokens (those of at most FOLD fold): batched with 40 prompt rows a step they
    give bitwise the tokens and logits of each alone with one prompt row a step; again with few blocks (queued,
    preempted and rebuilt, freed blocks poisoned with NaN) and every fifth request cancelled, mid-prompt where it
    can be: the others exact, the cancelled ones a prefix and their blocks freed at once."""
    model = hf_model if which == "hf" else cbk_model
    reqs = _requests(24, seed=3)
    assert sum(len(p) <= FOLD for p, _ in reqs) >= 8 and sum(len(p) > FOLD for p, _ in reqs) >= 8
    ref, ref_rows = _fold_alone(model, reqs)
    sch = _scheduler(model, max_batch=24, chunk=8, fold=FOLD, prefill_budget=40, overlap=overlap)
    handles = [sch.submit(p, _copy(s)) for p, s in reqs]
    sch.run()
    assert sch.peak_batch >= 12
    for i, (h, c) in enumerate(zip(handles, ref)):
        assert _same(h.completion, c), i
        assert len(sch.rows[i]) == len(ref_rows[i]) and _same_rows(sch.rows[i], ref_rows[i]), i
    sch = _scheduler(model, blocks=40, max_batch=24, chunk=8, fold=FOLD, prefill_budget=40, overlap=overlap)
    handles = [sch.submit(p, _copy(s)) for p, s in reqs]
    cancelled, mid_prompt = set(), 0
    while sch.has_work:
        sch.step()
        assert sch.kv.alloc.used == sum(len(r.blocks) for r in sch.active)
        for r in list(sch.active):
            if r.rid % 5 == 0 and r.rid not in cancelled and (0 < r.computed < len(r.prompt) or len(r.stream.out) >= 2):
                mid_prompt += r.state == "prefill"
                free = sch.kv.alloc.num_free + len(r.blocks)
                sch.cancel(r)
                assert sch.kv.alloc.num_free == free and r.completion.finish_reason == "cancelled"
                cancelled.add(r.rid)
    assert sch.preemptions > 0 and len(cancelled) == 5 and mid_prompt >= 1
    for i, (h, c) in enumerate(zip(handles, ref)):
        if i in cancelled:
            assert h.completion.token_ids == c.token_ids[:len(h.completion.token_ids)], i
        else:
            assert _same(h.completion, c), i
        assert _same_rows(sch.rows.get(i, []), ref_rows[i]), i
    assert sch.kv.alloc.num_free == sch.kv.num_blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_row_groups_bound_the_folded_rows_and_keep_the_tokens(overlap, cbk_model):
    """row_group 8: a step folds at most the rows left in its decode rows' last group of 8 (a whole group when none
    are left), so no step spills into a group its decode rows did not open; 24 requests (greedy and seeded, prompts
    of 1..37 tokens) still give bitwise the tokens and logits of each alone, and the runner's row_group is the
    default (0, none, on the CPU runner); a negative group is refused."""
    reqs = _requests(24, seed=5)
    ref, ref_rows = _fold_alone(cbk_model, reqs)
    sch = _scheduler(cbk_model, max_batch=24, chunk=8, fold=FOLD, prefill_budget=40, overlap=overlap, row_group=8)
    steps = []  # (decode rows, rows of the forward)
    fold_rows, decode = sch._fold_rows, sch.runner.decode
    sch._fold_rows = lambda d: steps.append([d, None]) or fold_rows(d)
    sch.runner.decode = lambda tables, *a: (steps[-1].__setitem__(1, len(tables)), decode(tables, *a))[1]
    handles = [sch.submit(p, _copy(s)) for p, s in reqs]
    sch.run()
    assert sch.peak_batch >= 12
    folded = [(d, n) for d, n in steps if n is not None and n > d]
    assert len(folded) >= 8 and any(d % 8 for d, _ in folded)
    for d, n in folded:
        assert n <= (-(-d // 8) * 8 if d % 8 else d + 8), (d, n)
    for i, (h, c) in enumerate(zip(handles, ref)):
        assert _same(h.completion, c), i
        assert _same_rows(sch.rows[i], ref_rows[i]), i
    assert _scheduler(cbk_model).row_group == 0
    with pytest.raises(TrapetumError, match="row group"):
        _scheduler(cbk_model, row_group=-1)


def test_a_folded_prompt_computes_the_prefill_logits(hf_model):
    """The first token's logits of a folded prompt (its rows in the decode forward, with other requests' decode
    rows beside them) against the prefill forward's, within fp32 rounding; fold 0 folds nothing."""
    prompts = [[1] + list(range(5, 5 + n)) for n in (3, 17, 30)]
    got = {}
    for fold in (0, 64):
        sch = _scheduler(hf_model, max_batch=8, chunk=8, fold=fold, prefill_budget=64 if fold else 8)
        hs = [sch.submit(p, GenerationSettings(max_new_tokens=3, ignore_eos=True)) for p in prompts]
        sch.step()
        assert [h.state for h in hs] == (["decode", "prefill", "prefill"] if fold == 0 else ["decode"] * 3)
        sch.run()
        got[fold] = [sch.rows[h.rid] for h in hs]
    for a, b in zip(got[64], got[0]):
        for x, y in zip(a, b):
            assert float((x.double() - y.double()).norm() / y.double().norm()) < 1e-5
    with pytest.raises(TrapetumError, match="fold"):
        _scheduler(hf_model, fold=-1)


# -- overlapped steps: the sequential scheduler's tokens, logits and events ------------------------------
def _mixed_run(model, reqs, eos: dict, overlap: bool, blocks: int, runner_wrap=None):
    """``reqs`` through one scheduler (prompts of at most FOLD tokens folded, 40 prompt rows a step), request i
    ending on token ``eos[i]`` as its EOS, every seventh request cancelled once 3 tokens of it landed: each
    request's completion, its events (text, token, done) and its logits rows; and the scheduler."""
    sch = _scheduler(model, blocks=blocks, max_batch=64, chunk=8, fold=FOLD, prefill_budget=40, overlap=overlap)
    if runner_wrap is not None:
        sch.runner = runner_wrap(sch.runner)
    hs = [sch.submit(p, _copy(s)) for p, s in reqs]
    for i, t in eos.items():
        hs[i].stream.eos = {t}
    events: dict[int, list] = {i: [] for i in range(len(hs))}
    while sch.has_work:
        for r in sch.step():
            if r.rid % 7 == 0 and not r.done and len(r.stream.out) >= 3:
                sch.cancel(r)
        assert all(r.computed <= r.positions for r in sch.active)  # no row past max_new_tokens
        for i, h in enumerate(hs):
            events[i] += [(e.text, e.token_id, e.done) for e in drain(h)]
    assert sch.kv.alloc.num_free == sch.kv.num_blocks and not sch.active and not sch.waiting
    return [h.completion for h in hs], events, sch


def _eos_for(reqs, ref) -> dict:
    """An EOS for every fourth request that does not ignore it: its third token alone (so EOS ends it early)."""
    return {i: c.token_ids[2] for i, ((_, s), c) in enumerate(zip(reqs, ref))
            if i % 4 == 3 and not s.ignore_eos and len(c.token_ids) > 3}


@pytest.mark.parametrize("blocks", [400, 60])
def test_overlapped_steps_give_the_sequential_tokens_logits_and_events(hf_model, alone, blocks):
    """64 mixed requests (prompts of 1..37 tokens, those of at most FOLD folded; greedy, seeded sampling, the
    repetition penalty; stop strings, EOS, max_new_tokens; cancellations), with room for all and with blocks
    exhausted (queued, preempted and rebuilt; freed blocks poisoned with NaN): overlapped steps give bitwise the
    sequential scheduler's completions, events and logits rows, each request's events at most a step later."""
    reqs, ref, _ = alone["hf"]
    eos = _eos_for(reqs, ref)
    assert len(eos) >= 8
    seq, seq_events, a = _mixed_run(hf_model, reqs, eos, False, blocks)
    got, got_events, b = _mixed_run(hf_model, reqs, eos, True, blocks)
    assert b.overlap and not a.overlap
    for i in range(len(reqs)):
        assert _same(got[i], seq[i]), i
        assert got_events[i] == seq_events[i], i
        assert len(b.rows[i]) == len(a.rows[i]) and _same_rows(b.rows[i], a.rows[i]), i
    finish = [c.finish_reason for c in seq]
    assert finish.count("cancelled") >= 5 and finish.count("length") >= 5 and finish.count("stop") >= 20
    by_eos = sum(c.finish_reason == "stop" and i in eos and eos[i] not in c.token_ids for i, c in enumerate(seq))
    assert by_eos >= 3  # EOS ended requests (it is never among the completion's tokens)
    if blocks == 60:
        assert a.preemptions > 0 and b.preemptions > 0
    assert b.steps <= a.steps + 1 + len(reqs)  # (a step more at the end, and a finished request's extra row)


class _WrongRow:
    """A runner whose overlapped rows take the token of the next pending row (a mutation the tests must see)."""

    def __init__(self, runner):
        self.runner, self.kv = runner, runner.kv
        self.prefill, self.replay = runner.prefill, runner.replay
        self.shuffled = 0

    def decode(self, tables, tokens, positions, prev=None, src=None):
        if prev is not None:
            live = [j for j in src if j >= 0]
            if len(live) > 1:
                rot = dict(zip(live, live[1:] + live[:1]))
                src = [rot[j] if j >= 0 else j for j in src]
                self.shuffled += 1
        return self.runner.decode(tables, tokens, positions, prev, src)


def test_a_wrong_rows_token_fails_the_comparison(hf_model, alone):
    """The mutation check: overlapped rows fed another row's pending token change some completions (so the
    comparison above would fail), and only the overlapped run sees pending tokens."""
    reqs, ref, _ = alone["hf"]
    reqs = reqs[:24]
    eos = _eos_for(reqs, ref)
    seq, _, _ = _mixed_run(hf_model, reqs, eos, False, 400)
    wrong = []
    got, _, sch = _mixed_run(hf_model, reqs, eos, True, 400, lambda r: wrong.append(_WrongRow(r)) or wrong[-1])
    assert wrong[0].shuffled > 3
    assert sum(not _same(g, c) for g, c in zip(got, seq)) >= 3
    plain = []
    _mixed_run(hf_model, reqs, eos, False, 400, lambda r: plain.append(_WrongRow(r)) or plain[-1])
    assert plain[0].shuffled == 0


def test_a_request_preempted_with_its_token_pending(hf_model):
    """Overlapped steps over few blocks (tiny prompts, a block of 4 positions): requests preempted while their
    last token is still pending (its landing may end them: they leave the queue then) give the sequential
    scheduler's tokens; the grid holds such preemptions."""
    rng = random.Random(5)
    pending = 0
    for case in range(12):
        reqs = [([1] + [rng.randrange(3, 300) for _ in range(rng.randrange(0, 7))],
                 GenerationSettings(max_new_tokens=rng.randrange(1, 9), ignore_eos=True,
                                    **({"temperature": 0.8, "seed": case} if case % 2 else {})))
                for _ in range(6)]
        out = {}
        for overlap in (False, True):
            sch = _scheduler(hf_model, blocks=6, block_size=4, max_batch=6, chunk=8, overlap=overlap)
            hs = [sch.submit(p, _copy(s)) for p, s in reqs]
            sch.run()
            assert sch.kv.alloc.num_free == sch.kv.num_blocks and not sch.waiting
            out[overlap] = [h.completion.token_ids for h in hs]
            pending += getattr(sch, "preempted_pending", 0) if overlap else 0
        assert out[True] == out[False], case
    assert pending >= 3


def test_a_request_preempted_with_its_last_token_pending_leaves_the_queue(hf_model):
    """Overlapped, 3 blocks of 4 positions, both prompts folded: B (prompt 4, 2 new tokens) takes the spare block
    for its second row; the next step A (prompt 3) needs a block, and B, the newest, is preempted while its last
    token is pending; that token lands and ends B, which leaves the queue (not readmitted): both as sequential."""
    out = {}
    for overlap in (False, True):
        sch = _scheduler(hf_model, blocks=3, block_size=4, max_batch=2, chunk=8, fold=8, prefill_budget=16,
                         overlap=overlap)
        a = sch.submit([1, 5, 6], GenerationSettings(max_new_tokens=6, ignore_eos=True))
        b = sch.submit([1, 7, 8, 9], GenerationSettings(max_new_tokens=2, ignore_eos=True))
        for _ in range(40):
            if not sch.has_work:
                break
            sch.step()
        assert not sch.has_work and not sch.waiting and sch.kv.alloc.num_free == 3
        assert (a.completion.finish_reason, b.completion.finish_reason) == ("length", "length")
        out[overlap] = (a.completion.token_ids, b.completion.token_ids)
        assert getattr(sch, "preempted_pending", 0) == (1 if overlap else 0)
    assert out[True] == out[False]
