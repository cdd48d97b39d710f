"""Speculative decoding benchmark: end to end (prefill start to last token), plain and speculative in the same
process on the same weights; every speculative output is checked token for token against the plain one.

    python -m trapetum.eval.bench_spec --out DIR                       (GPU: the modeled part, defaults below)
        [--target llama3-8b:cb4] [--draft llama3.2-1b:cb4] [--kinds pard,draft] [--pard-k 3,7] [--draft-k 3]
        [--alpha 0.6,0.8] [--prompts 8] [--new-tokens 256] [--reps 2] [--loops pipelined,sync]
    python -m trapetum.eval.bench_spec --out DIR --real MODEL [--real-draft ngram,PATH.cbk,pard:PATH]
        [--real-k 3,7] [--real-new-tokens 128] [--device cuda|cpu] [--real-prompts N] [--skip-modeled]

Modeled part (random weights at real shapes, eval/random_model.py; GPU): a target engine and a drafter engine;
random-weight models cannot show real acceptance, so each speculative arm runs the real drafter (PARD: one forward
over the new tokens plus K - 1 mask tokens; draft model: K autoregressive steps) for its cost every round, but
proposes scripted tokens that agree with the target's own greedy output with per-token probability alpha
("modeled acceptance", runtime/speculative/scripted.py). Each arm runs in each loop of ``--loops``: "pipelined"
(runtime/speculative/pipeline.py: round r + 1 queued before round r's verdict is read back; what the runner picks
on CUDA) and "sync" (a read-back per round before the next is launched; the arm's name ends in "sync"). Prompts: random tokens, lengths 32 .. 256, greedy,
``--new-tokens`` each. Before timing, every verify graph (1 .. 16 rows) and the prefill graph of every prompt length
of both engines are captured (a server's steady state) and each arm runs once. Reps alternate the arm order; tok/s pools all reps.

Real part (``--real MODEL``): the prompt set of eval/spec_prompts.py (12 prompts: edit, summarize, code, continue),
greedy with EOS, ``--real-new-tokens`` at most; plain, then each drafter of ``--real-draft`` at each K, through
runtime/generate.stream_tokens (detokenization and stop handling in both arms). Real acceptance, tokens per round
and end-to-end speedup, per prompt kind and pooled. On the CPU the target is the reference decoder, whose verify
computes its rows one by one (the bitwise contract), so a round costs K + 1 one-token forwards there: the CPU
speedup is below 1 by construction, and the acceptance figures are what carries over.

Writes results.json and results.md under DIR; exits 1 when any speculative output differs from plain.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ..runtime.generate import stream_tokens
from ..runtime.sampling import GenerationSettings
from ..runtime.speculative import (DraftModelDrafter, EngineRows, PardDrafter, ScriptedDrafter, SpecStats,
                                   SpeculativeRunner, make_drafter, model_rows)
from ..settings import Options
from .random_model import SHAPES, random_checkpoint


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def warm(engine, prompt_lens=()) -> None:
    """Capture every verify graph (1 .. 16 rows), both decode-step graphs and the prefill graphs of the prompt
    lengths ``prompt_lens`` of ``engine`` (a padded prefill is captured at its bucket's second use)."""
    for n in prompt_lens:
        for _ in range(2):
            engine.prefill(torch.zeros(n, dtype=torch.long, device=engine.device))
    for m in range(1, 17):
        engine.verify(torch.zeros(m, dtype=torch.long, device=engine.device), 0)
    engine.set_position(0, 0)
    engine.step(True)
    engine.set_position(0, 0)
    engine.step(False)
    _sync(engine.device)


def timed_tokens(runner, prompt: list[int], n: int, device) -> tuple[list[int], float]:
    s = GenerationSettings(max_new_tokens=n)
    _sync(device)
    t0 = time.perf_counter()
    out = list(runner.tokens(prompt, s, len(prompt) + n))
    _sync(device)
    return out, time.perf_counter() - t0


def _spec(shape_fmt: str) -> tuple[str, str]:
    shape, _, fmt = shape_fmt.partition(":")
    return shape, fmt or "cb4"


def modeled(args) -> dict:
    from ..runtime.engine import GpuEngine
    opts = Options.from_env()
    tshape, tfmt = _spec(args.target)
    dshape, dfmt = _spec(args.draft)
    lens = [n for n in (32, 64, 128, 256) if n <= args.max_prompt] or [args.max_prompt]
    g = torch.Generator().manual_seed(0)
    max_len = max(lens) + args.new_tokens + 32
    dev = args.device
    def layers(shape):  # --layers N: at most the first N layers of each model (a smoke run)
        return min(args.layers, SHAPES[shape]["num_layers"]) if args.layers else None
    te = GpuEngine(random_checkpoint(tshape, tfmt, device=dev, layers=layers(tshape)), max_len, device=dev, options=opts)
    de = GpuEngine(random_checkpoint(dshape, dfmt, device=dev, layers=layers(dshape)), max_len, device=dev, options=opts)
    V = te.cfg.vocab_size
    if de.cfg.vocab_size != V:
        raise SystemExit(f"--draft {args.draft}: vocabulary {de.cfg.vocab_size} differs from the target's {V}")
    prompts = [torch.randint(3, V, (lens[i % len(lens)],), generator=g).tolist() for i in range(args.prompts)]
    warm(te, lens)
    warm(de, lens)
    target = EngineRows(te)
    truth = [timed_tokens(te, p, args.new_tokens, dev)[0] for p in prompts]  # also the plain arm's warm-up
    arms = [("plain", None, 0, 0.0)]
    for kind in args.kinds.split(","):
        for k in (args.pard_k if kind == "pard" else args.draft_k):
            for a in args.alpha:
                for loop in args.loops:
                    arms.append((loop, kind, k, a))
    res = {name: {"seconds": 0.0, "tokens": 0, "identical": 0, "runs": 0, "stats": SpecStats()} for name in
           (_arm_name(*a) for a in arms)}

    def run(arm, rep: int, warmup: bool = False) -> None:
        label, kind, k, a = arm
        r = res[_arm_name(*arm)]
        for i, p in enumerate(prompts[:1] if warmup else prompts):
            n = 32 if warmup else args.new_tokens
            if kind is None:
                out, dt = timed_tokens(te, p, n, dev)
            else:
                inner = (PardDrafter(EngineRows(de), mask_token=de.cfg.vocab_size - 1) if kind == "pard"
                         else DraftModelDrafter(EngineRows(de)))
                drafter = ScriptedDrafter.modeled(p + truth[i], a, V, seed=1000 * rep + i, device=dev, inner=inner)
                runner = SpeculativeRunner(target, drafter, k, pipelined=label == "pipelined")
                out, dt = timed_tokens(runner, p, n, dev)
                if not warmup:
                    r["stats"].add(runner.stats)
            if not warmup:
                r["seconds"] += dt
                r["tokens"] += len(out)
                r["runs"] += 1
                r["identical"] += out == truth[i][:n]

    for arm in arms[1:]:
        run(arm, 0, warmup=True)
    for rep in range(args.reps):
        for arm in (arms if rep % 2 == 0 else arms[::-1]):
            run(arm, rep)
            print(f"rep {rep} {_arm_name(*arm)}: {_rate(res[_arm_name(*arm)]):.1f} tok/s", flush=True)
    plain = _rate(res["plain"])
    rows = []
    for arm in arms:
        r = res[_arm_name(*arm)]
        st = r["stats"]
        rows.append({"arm": _arm_name(*arm), "kind": arm[1] or "plain", "k": arm[2], "alpha": arm[3],
                     "loop": arm[0] if arm[1] else "-",
                     "tok_s": _rate(r), "speedup": _rate(r) / plain, "tokens_per_round": st.tokens_per_round,
                     "acceptance": st.acceptance, "per_token": st.alpha, "identical": r["identical"], "runs": r["runs"],
                     "ms_per_round": 1e3 * r["seconds"] / st.rounds if st.rounds else None})
    return {"target": args.target, "draft": args.draft, "prompts": args.prompts, "new_tokens": args.new_tokens,
            "reps": args.reps, "prompt_lens": lens, "layers": args.layers, "rows": rows}


def _arm_name(label, kind, k, a) -> str:
    return "plain" if kind is None else f"{kind} K={k} alpha={a:g}" + (" sync" if label == "sync" else "")


def _rate(r: dict) -> float:
    return r["tokens"] / r["seconds"] if r["seconds"] else 0.0


def real(args) -> dict:
    from ..api import load
    from .spec_prompts import PROMPTS, encode
    device = args.device
    m = load(args.real, device=device)
    target = model_rows(engine=m.engine, decoder=None if m.engine is not None else m.decoder, max_len=m.context_size)
    prompts = PROMPTS[:args.real_prompts] if args.real_prompts else PROMPTS
    ids = [encode(m, chat, text) for _, _, chat, text in prompts]
    s = GenerationSettings(max_new_tokens=args.real_new_tokens)

    def go(runner, p):
        _sync(device)
        t0 = time.perf_counter()
        comp = None
        for ev in stream_tokens(runner, m.tokenizer, p, GenerationSettings(**vars(s)), m.context_size):
            if ev.done:
                comp = ev.completion
        _sync(device)
        return comp, time.perf_counter() - t0

    if m.engine is not None:
        warm(m.engine)
        go(m.runner, ids[0])
    arms = []  # (spec, k, runner)
    for spec in args.real_draft:
        drafter, dm = make_drafter(spec, load=lambda path: load(path, device=device), target_tokenizer=m.tokenizer,
                                   max_len=m.context_size)
        if dm is not None and dm.engine is not None:
            warm(dm.engine)
        for k in args.real_k:
            arms.append((spec, k, SpeculativeRunner(target, drafter, k)))
            go(arms[-1][2], ids[0])  # warm-up
    plain, got, stats = [], [[] for _ in arms], [[] for _ in arms]
    for i, p in enumerate(ids):  # prompt by prompt, the arm order alternating: drift hits every arm alike
        order = list(range(-1, len(arms)))
        for a in (order if i % 2 == 0 else order[::-1]):
            if a < 0:
                plain.append(go(m.runner, p))
            else:
                got[a].append(go(arms[a][2], p))
                stats[a].append(arms[a][2].stats)
        print(f"prompt {i}: plain {plain[-1][0].completion_tokens} tokens in {plain[-1][1]:.2f} s", flush=True)
    rows = [_real_row("plain", 0, prompts, plain, plain, [None] * len(ids))]
    for a, (spec, k, _) in enumerate(arms):
        rows.append(_real_row(spec, k, prompts, got[a], plain, stats[a]))
        print(f"{spec} K={k}: {rows[-1]['pooled']}", flush=True)
    return {"model": args.real, "device": device, "new_tokens": args.real_new_tokens, "prompts": len(ids),
            "prompt_tokens": [len(p) for p in ids], "rows": rows}


def _real_row(spec: str, k: int, prompts, got, plain, stats) -> dict:
    kinds = sorted({p[0] for p in prompts}, key=[p[0] for p in prompts].index)

    def pool(idx):
        toks = sum(got[i][0].completion_tokens for i in idx)
        secs = sum(got[i][1] for i in idx)
        ptoks = sum(plain[i][0].completion_tokens for i in idx)
        psecs = sum(plain[i][1] for i in idx)
        st = SpecStats()
        for i in idx:
            if stats[i] is not None:
                st.add(stats[i])
        rate, prate = toks / secs, ptoks / psecs
        return {"tok_s": rate, "speedup": rate / prate, "tokens_per_round": st.tokens_per_round,
                "acceptance": st.acceptance, "per_token": st.alpha, "tokens": toks, "seconds": secs,
                "identical": sum(got[i][0].token_ids == plain[i][0].token_ids for i in idx), "runs": len(idx)}

    by_kind = {kd: pool([i for i, p in enumerate(prompts) if p[0] == kd]) for kd in kinds}
    return {"draft": spec, "k": k, "pooled": pool(list(range(len(prompts)))), "by_kind": by_kind}


def markdown(results: dict) -> str:
    lines = [f"{results['gpu']}, torch {results['torch']}, {results['date']}", ""]
    mod = results.get("modeled")
    if mod:
        lines += [f"Modeled acceptance: target {mod['target']}, drafter {mod['draft']} (random weights), "
                  f"{mod['prompts']} prompts of {mod['prompt_lens']} tokens cycled, {mod['new_tokens']} new tokens "
                  f"each, greedy, {mod['reps']} reps", "",
                  "| arm | tok/s | speedup | tokens / round | drafts accepted | per-token acceptance | ms / round | "
                  "identical |", "|---|---|---|---|---|---|---|---|"]
        for r in mod["rows"]:
            mpr = f"{r['ms_per_round']:.2f}" if r["ms_per_round"] else "-"
            lines.append(f"| {r['arm']} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | {_f(r['tokens_per_round'])} | "
                         f"{_f(r['acceptance'], 3)} | {_f(r['per_token'], 3)} | {mpr} | {r['identical']}/{r['runs']} |")
    rl = results.get("real")
    if rl:
        lines += ["", f"Real model {rl['model']} on {rl['device']}: {rl['prompts']} prompts (eval/spec_prompts.py; "
                  f"{min(rl['prompt_tokens'])}-{max(rl['prompt_tokens'])} tokens), greedy with EOS, at most "
                  f"{rl['new_tokens']} new tokens", "",
                  "| drafter | K | prompts | tokens | tok/s | speedup | tokens / round | drafts accepted | "
                  "per-token acceptance | identical |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rl["rows"]:
            for name, d in [("all", r["pooled"])] + list(r["by_kind"].items()):
                lines.append(f"| {r['draft']} | {r['k'] or '-'} | {name} | {d['tokens']} | {d['tok_s']:.2f} | "
                             f"{d['speedup']:.2f}x | {_f(d['tokens_per_round'])} | {_f(d['acceptance'], 3)} | "
                             f"{_f(d['per_token'], 3)} | {d['identical']}/{d['runs']} |")
    return "\n".join(lines) + "\n"


def _f(v: float, digits: int = 2) -> str:
    return f"{v:.{digits}f}" if v else "-"


def _loops(s: str) -> list[str]:
    out = [x for x in s.split(",") if x]
    if not out or any(x not in ("pipelined", "sync") for x in out):
        raise argparse.ArgumentTypeError(f"pipelined and/or sync, comma-separated, got {s!r}")
    return out


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (also those of ``trapetum bench spec``)."""
    p.add_argument("--out", default="out/bench-spec")
    p.add_argument("--target", default="llama3-8b:cb4", help="SHAPE:FORMAT of eval/random_model.py")
    p.add_argument("--draft", default="llama3.2-1b:cb4")
    p.add_argument("--kinds", default="pard,draft", help="drafters of the modeled part: pard, draft")
    p.add_argument("--pard-k", type=_ints, default=[3, 7])
    p.add_argument("--draft-k", type=_ints, default=[3])
    p.add_argument("--alpha", type=lambda s: [float(x) for x in s.split(",") if x], default=[0.6, 0.8])
    p.add_argument("--loops", type=_loops, default=["pipelined", "sync"],
                   help="modeled part: the speculative loops each arm runs in (pipelined, sync)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--skip-modeled", action="store_true")
    p.add_argument("--layers", type=int, default=None, help="modeled part: only the first N layers (smoke runs)")
    p.add_argument("--max-prompt", type=int, default=256, help="modeled part: longest prompt (32, 64, 128, 256)")
    p.add_argument("--real", default=None, help="a real model for the real-acceptance part")
    p.add_argument("--real-draft", type=lambda s: [x for x in s.split(",") if x], default=["ngram"])
    p.add_argument("--real-k", type=_ints, default=[3, 7])
    p.add_argument("--real-new-tokens", type=int, default=128)
    p.add_argument("--real-prompts", type=int, default=0, help="only the first N prompts (0: all 12)")
    p.add_argument("--device", default=None, help="real part: cpu or cuda (default cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (CPU runs)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_args(p.parse_args(argv))


def run_args(a: argparse.Namespace) -> int:
    if a.threads:
        torch.set_num_threads(a.threads)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    results = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
               "command": " ".join(["python -m trapetum.eval.bench_spec"] + sys.argv[1:])}
    if not a.skip_modeled:
        if a.device != "cuda" and a.layers is None:
            raise SystemExit("the modeled part runs on a CUDA GPU (on the CPU only as a smoke run with --layers N; "
                             "--skip-modeled --real MODEL measures a real model on the CPU)")
        results["modeled"] = modeled(a)
    if a.real:
        results["real"] = real(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    md = markdown(results)
    (out / "results.md").write_text(md)
    print(md)
    rows = (results.get("modeled") or {}).get("rows", []) + [
        d for r in (results.get("real") or {}).get("rows", []) for d in [r["pooled"]]]
    bad = [r for r in rows if r["identical"] != r["runs"]]
    if bad:
        print(f"NOT EXACT: {len(bad)} arm(s) with outputs that differ from plain decoding")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
