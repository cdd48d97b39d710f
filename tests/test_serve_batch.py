"""Batched serving through the real HTTP server (``trapetum serve --max-batch N --kv-blocks N``, a subprocess) on a
tiny random model with a tokenizer: concurrent requests (streamed and not, greedy and seeded, stop strings) give
exactly what each gives alone; /health reports the batch's load; a request larger than the KV cache is a 400;
a disconnect cancels within a second and frees its blocks. ``Model.generate_batch`` gives each prompt's
alone completion in-process."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

import serve_fixtures as F
from tiny_models import build

BLOCKS = 24  # 384 positions: 8 concurrent requests of up to ~80 positions need more, so some are preempted (the
# scheduler prefills one prompt per step: the requests enter decoding a step apart and must overlap long enough)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama3")
    build("llama3", d, tokenizer=True)
    return d


@pytest.fixture(scope="module")
def server(model_dir):
    srv = F.start_serve([f"tiny={model_dir}", "--max-batch", "8", "--kv-blocks", str(BLOCKS), "--threads", "1",
                         "--queue", "64"])
    yield srv
    srv.stop()


def _body(i: int) -> dict:
    words = ["the", "king", "shall", "speak", "to", "his", "lords", "and", "all", "men"]
    body = {"model": "tiny", "prompt": " ".join(words[: 2 + i % 9]) * (1 + i % 3), "max_tokens": 20 + i % 17,
            "temperature": 0, "stream": i % 2 == 0}
    if i % 4 == 1:
        body.update(temperature=0.9, top_k=50, seed=100 + i)
    if i % 4 == 3:
        body.update(temperature=0.8, top_p=0.9, seed=7 * i)
    if i % 3 == 0:
        body["stop"] = ["e", "ou"]
    if i % 5 == 0:
        body["ignore_eos"] = True
    return body


async def _one(c: httpx.AsyncClient, url: str, body: dict) -> tuple:
    if not body["stream"]:
        r = await c.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        j = r.json()
        return j["choices"][0]["text"], j["choices"][0]["finish_reason"], j["usage"]["completion_tokens"]
    async with c.stream("POST", url + "/v1/completions", json={**body, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = F.sse_events([line async for line in r.aiter_lines()])
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    return text, finish[-1], events[-2]["usage"]["completion_tokens"]


def _run(url: str, bodies: list[dict], concurrent: bool) -> list[tuple]:
    async def main():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=100)) as c:
            if concurrent:
                return await asyncio.gather(*(_one(c, url, b) for b in bodies))
            return [await _one(c, url, b) for b in bodies]
    return asyncio.run(main())


def _engine(srv) -> dict:
    return srv.health()[1]["engines"][0]


def _idle(srv, timeout=10.0) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        eng = _engine(srv)
        if eng["running"] == 0 and eng["waiting"] == 0:
            return time.perf_counter() - t0
        time.sleep(0.02)
    raise AssertionError(f"engine still busy after {timeout}s: {srv.health()}")


def test_concurrent_requests_give_their_alone_completions(server):
    bodies = [_body(i) for i in range(24)]
    alone = _run(server.url, bodies, concurrent=False)
    assert sum(f == "stop" for _, f, _ in alone) >= 4 and sum(f == "length" for _, f, _ in alone) >= 4
    together = _run(server.url, bodies, concurrent=True)
    for i, (a, b) in enumerate(zip(alone, together)):
        assert a == b, (i, bodies[i], a, b)
    load = _engine(server)["batch"]["tiny"]
    assert load["max_batch"] == 8 and load["total_blocks"] == BLOCKS and load["preemptions"] > 0
    _idle(server)
    assert _engine(server)["batch"]["tiny"]["free_blocks"] == BLOCKS


def test_health_reports_the_batch_during_load(server):
    bodies = [{"model": "tiny", "prompt": "the king", "max_tokens": 100, "ignore_eos": True, "temperature": 0,
               "stream": True} for _ in range(3)]  # 7 blocks each at most: the three fit

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            streams = [c.stream("POST", server.url + "/v1/completions", json=b) for b in bodies]
            for s in streams:
                await s.__aenter__()
            seen, worst = None, 0.0
            for _ in range(200):  # the three decode together for a while: /health shows them
                t0 = time.perf_counter()
                code, h = server.health()
                worst = max(worst, time.perf_counter() - t0)
                assert code == 200
                if h["engines"][0]["running"] == 3:
                    seen = h["engines"][0]
                    break
            for s in streams:
                await s.__aexit__(None, None, None)
            return seen, worst
    eng, worst = asyncio.run(main())
    assert eng is not None and worst < 1.0
    assert eng["batch"]["tiny"]["running"] == 3 and eng["batch"]["tiny"]["free_blocks"] <= BLOCKS - 3
    assert _idle(server) < 1.0  # closing the streams cancelled the generations
    assert _engine(server)["batch"]["tiny"]["free_blocks"] == BLOCKS


def test_disconnect_cancels_within_a_second(server):
    before = _engine(server)["cancelled"]
    waits = []
    for i in range(5):
        body = {"model": "tiny", "prompt": f"count {i}", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    break
        waits.append(_idle(server, timeout=5))
    assert max(waits) < 1.0, waits
    assert _engine(server)["cancelled"] - before == 5
    assert _engine(server)["batch"]["tiny"]["free_blocks"] == BLOCKS


def test_request_larger_than_the_kv_cache_is_a_400(model_dir):
    srv = F.start_serve([f"tiny={model_dir}", "--kv-blocks", "8", "--threads", "1"])  # 128 positions
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "the king", "max_tokens": 200},
                       timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "kv_cache_too_small" and err["param"] == "max_tokens" and "--kv-blocks" in err["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "the king", "max_tokens": 100},
                       timeout=30)
        assert r.status_code == 200 and srv.health()[0] == 200
    finally:
        srv.stop()


def test_generate_batch_gives_each_prompts_alone_completion(model_dir):
    import trapetum
    m = trapetum.load(str(model_dir))
    prompts = ["the king", "shall speak to his lords", [1, 5, 9, 14], "and all men " * 3]
    kw = dict(max_new_tokens=12, temperature=0.8, seed=5, stop=["ou"])
    batch = m.generate_batch(prompts, **kw)
    for p, c in zip(prompts, batch):
        alone = m.generate_batch([p], **kw)[0]
        assert (c.token_ids, c.text, c.finish_reason) == (alone.token_ids, alone.text, alone.finish_reason)
    assert len(batch) == 4 and all(c.completion_tokens > 0 for c in batch)


def test_prefill_budget_flag_reaches_the_scheduler(model_dir):
    """``serve --prefill-budget N`` -> the batch options -> ``Model.batch_scheduler`` -> Scheduler.prefill_budget;
    without it the scheduler's default (one chunk: one prefill forward per step)."""
    import argparse

    import trapetum
    from trapetum.commands import serve as cmd
    sub = argparse.ArgumentParser().add_subparsers(dest="cmd")
    cmd.register(sub)
    parse = sub.choices["serve"].parse_args
    m = trapetum.load(str(model_dir))
    for argv, want in (([], 128), (["--prefill-budget", "512"], 512)):
        opts = cmd._batch(parse(["x.cbk", "--max-batch", "4", "--kv-blocks", "40", *argv]))
        assert m.batch_scheduler(**opts).prefill_budget == want, argv


def test_fold_prompts_flag_reaches_the_scheduler(model_dir):
    """``serve --fold-prompts N`` -> the batch options -> Scheduler.fold (default: the CPU runner's 0); a negative
    N is a one-line user error."""
    import argparse

    import trapetum
    from trapetum.commands import serve as cmd
    from trapetum.errors import TrapetumError
    sub = argparse.ArgumentParser().add_subparsers(dest="cmd")
    cmd.register(sub)
    parse = sub.choices["serve"].parse_args
    m = trapetum.load(str(model_dir))
    for argv, want in (([], 0), (["--fold-prompts", "64"], 64)):
        opts = cmd._batch(parse(["x.cbk", "--max-batch", "4", "--kv-blocks", "40", *argv]))
        assert m.batch_scheduler(**opts).fold == want, argv
    with pytest.raises(TrapetumError, match="--fold-prompts"):
        cmd._batch(parse(["x.cbk", "--max-batch", "4", "--fold-prompts", "-1"]))


def test_overlap_flag_reaches_the_scheduler(model_dir):
    """``serve --overlap / --no-overlap`` -> the batch options -> Scheduler.overlap (default: the CPU runner's,
    off); the batch API takes it too, and the completions are the same either way."""
    import argparse

    import trapetum
    from trapetum.commands import serve as cmd
    sub = argparse.ArgumentParser().add_subparsers(dest="cmd")
    cmd.register(sub)
    parse = sub.choices["serve"].parse_args
    m = trapetum.load(str(model_dir))
    for argv, want in (([], False), (["--overlap"], True), (["--no-overlap"], False)):
        opts = cmd._batch(parse(["x.cbk", "--max-batch", "4", "--kv-blocks", "40", *argv]))
        assert m.batch_scheduler(**opts).overlap is want, argv
    got = {}
    for overlap in (False, True):
        sch = m.batch_scheduler(4, kv_blocks=40, overlap=overlap)
        reqs = [sch.submit(m.encode(p), m._settings(None, {"max_new_tokens": 6, "ignore_eos": True}))
                for p in ("Hello there", "A much longer prompt of some words", "x")]
        sch.run()
        got[overlap] = [r.completion.token_ids for r in reqs]
    assert got[True] == got[False]


def test_kernel_flags_reach_the_loaded_model(model_dir, monkeypatch):
    """``serve --many-rows mma --aqlm-kernel mma`` -> each ModelSpec's options -> ``trapetum.load(options=)``: the
    served model runs with those kernel options (the batched GPU engine's GEMVs read them); without the flags the
    specs carry none and the environment's options apply."""
    import argparse

    from trapetum.commands import serve as cmd
    from trapetum.serve import server
    sub = argparse.ArgumentParser().add_subparsers(dest="cmd")
    cmd.register(sub)
    parse = sub.choices["serve"].parse_args
    got = {}
    monkeypatch.setattr(server, "run", lambda specs, **kw: got.setdefault("specs", specs))
    cmd.run(parse([f"tiny={model_dir}", "--many-rows", "mma", "--aqlm-kernel", "mma", "--wgmma-warpgroups", "2",
                   "--threads", "1"]))
    (spec,) = got.pop("specs")
    alias, m = spec.load()
    assert alias == "tiny" and m.options.kernels.many_rows == "mma" and m.options.kernels.aqlm_kernel == "mma"
    assert m.options.kernels.wgmma_warpgroups == 2
    cmd.run(parse([f"tiny={model_dir}", "--threads", "1"]))
    assert got["specs"][0].options is None
