"""The CLI as a new user meets it: start-up times, and the default CPU thread count under competing load.

    trapetum bench cli [--out DIR] [--cbk FILE] [--loads 0,1,2] [--nice 0] [--repeats 3] [--tokens 32] [--tree DIR]
    python -m trapetum.eval.bench_cli ...

Every figure comes from a fresh ``python -m trapetum.cli`` process running the source tree ``--tree`` (default:
the tree of this module; ``--tree`` names another checkout, e.g. an older commit for a before/after comparison;
the console script on PATH may belong to another install), timed by wall clock from this process:

* start-up: ``trapetum --help``, ``trapetum generate --help``, ``trapetum info FILE.cbk``, ``trapetum info``
  (the embedded GGUF) and ``trapetum verify FILE.cbk`` (start-up plus hashing the file), median of
  ``--repeats``. FILE.cbk is ``--cbk``, else a quick 4-bit .cbk of the embedded model made once under DIR
  (``quantize --calib none --iters 2``: for timing ``info``, not for quality);
* the README's first command after install, ``trapetum generate --chat "What is the capital of France?"
  --max-new-tokens 48``: wall time with no competing load;
* threads: for each competing load L of ``--loads`` (L busy-looping processes that this benchmark starts, at
  ``--nice``), ``generate -n TOKENS --ignore-eos --stats`` on the embedded model with ``--threads 1 .. CPUs`` and
  with the default, in turn (round robin, ``--repeats`` rounds), median tok/s and first-token time; the
  default's tok/s against the best fixed count's (the bar: within 20%).

Writes DIR/cli.json and DIR/cli.md and prints the tables. The machine's own load (other users) is recorded
before each section: on a shared machine it is part of the conditions.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

QUESTION = "What is the capital of France?"
STATS = re.compile(r"\[(\d+) tokens, ([\d.]+) tok/s, first token (\d+) ms, finish \w+, (?:(\d+) threads?|torch's "
                   r"threads) \(([^)]*)\)\]")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="out/bench-cli", metavar="DIR", help="where cli.json and cli.md go "
                   "(default out/bench-cli)")
    p.add_argument("--cbk", default=None, metavar="FILE", help="the .cbk file for `info` (default: made once in DIR)")
    p.add_argument("--loads", default="0,1,2", metavar="L,...",
                   help="competing busy processes for the thread comparison (default 0,1,2)")
    p.add_argument("--nice", type=int, default=0, help="nice level of the competing processes (default 0, ours)")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure, the median is kept (default 3)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per generate run (default 32)")
    p.add_argument("--skip-threads", action="store_true", help="start-up times and the first command only")
    p.add_argument("--tree", default=None, metavar="DIR",
                   help="source tree to run (its trapetum/ package; default: this one's)")


TREE = Path(__file__).resolve().parents[2]  # the checkout this module belongs to
_CWD: list[Path] = [TREE]


def use_tree(tree: Path) -> None:
    """Run the ``trapetum`` of ``tree`` in every timed process (``python -m`` puts its working directory, the
    tree, first on sys.path)."""
    if not (tree / "trapetum" / "cli.py").is_file():
        from ..errors import TrapetumError
        raise TrapetumError(f"--tree {tree}: no trapetum/cli.py there")
    _CWD[0] = tree


def trapetum_cmd() -> list[str]:
    return [sys.executable, "-m", "trapetum.cli"]


def load_avg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def timed(argv: list[str], timeout: float = 600) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                       cwd=_CWD[0])
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.strip()[-400:]}")
    return dt, r


def median_time(argv: list[str], repeats: int) -> float:
    return statistics.median(timed(argv)[0] for _ in range(repeats))


def quick_cbk(out: Path) -> Path:
    from ..formats.detect import default_model_path
    path = out / "smollm2-135m-q4-quick.cbk"
    if not path.exists():
        out.mkdir(parents=True, exist_ok=True)
        timed(trapetum_cmd() + ["quantize", str(default_model_path()), "-o", str(path), "--calib", "none",
                                "--iters", "2", "--quiet"], timeout=3600)
    return path


class Competitors:
    """``n`` busy-looping processes at ``nice`` for the duration of a ``with`` block."""

    def __init__(self, n: int, nice: int):
        self.n, self.nice, self.procs = n, nice, []

    def __enter__(self):
        for _ in range(self.n):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", f"import os; os.nice({self.nice}); p = os.getppid()\n"
                                  "while os.getppid() == p: pass"],  # ends with this benchmark, however it ends
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.5 if self.n else 0)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def generate_run(threads: int | None, tokens: int) -> dict:
    argv = trapetum_cmd() + ["generate", "Once upon a time", "-n", str(tokens), "--ignore-eos", "--stats"]
    if threads is not None:
        argv += ["--threads", str(threads)]
    wall, r = timed(argv)
    m = STATS.search(r.stderr)
    if m is None:
        raise RuntimeError(f"no --stats line in: {r.stderr.strip()[-300:]}")
    return {"tok_s": float(m.group(2)), "ttft_ms": int(m.group(3)), "threads": int(m.group(4) or 0),
            "why": m.group(5), "wall_s": round(wall, 2)}


def thread_table(loads: list[int], nice: int, repeats: int, tokens: int, cpus: int) -> list[dict]:
    rows = []
    for n in loads:
        with Competitors(n, nice):
            row: dict = {"competitors": n, "nice": nice, "loadavg_1m": round(load_avg(), 2), "fixed": {}}
            choices = list(range(1, cpus + 1)) + [None]
            seen: dict = {t: [] for t in choices}
            for _ in range(repeats):  # round robin: every choice sees the same changing conditions (other users)
                for t in choices:
                    seen[t].append(generate_run(t, tokens))
            for t in choices:
                runs = seen[t]
                fig = {"tok_s": statistics.median(r["tok_s"] for r in runs),
                       "ttft_ms": statistics.median(r["ttft_ms"] for r in runs)}
                if t is None:
                    fig["chosen"] = [r["threads"] for r in runs]
                    fig["why"] = runs[-1]["why"]
                    row["default"] = fig
                else:
                    row["fixed"][t] = fig
            best_t = max(row["fixed"], key=lambda k: row["fixed"][k]["tok_s"])
            row["best_fixed"] = best_t
            row["default_vs_best"] = round(row["default"]["tok_s"] / row["fixed"][best_t]["tok_s"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def markdown(res: dict) -> str:
    lines = [f"`{res['command']}` on {res['machine']}, {res['date']}", "",
             "| start-up (median of %d) | wall s | load avg 1 min |" % res["repeats"], "|---|---|---|"]
    for name, v in res["startup"].items():
        lines.append(f"| `{name}` | {v['wall_s']:.2f} | {v['loadavg_1m']:.2f} |")
    fc = res.get("first_command")
    if fc:
        lines += ["", f"README's first command after install, `{fc['command']}`: {fc['wall_s']:.1f} s wall "
                      f"(load avg {fc['loadavg_1m']:.2f}); answer: {fc['answer']!r}"]
    if res.get("threads"):
        cpus = res["cpus"]
        head = " | ".join(f"--threads {t}" for t in range(1, cpus + 1))
        lines += ["", f"| competing busy processes (nice {res['threads'][0]['nice']}) | load avg | {head} | default "
                      "(chosen) | default / best |", "|---" * (cpus + 4) + "|"]
        for r in res["threads"]:
            cells = " | ".join(f"{r['fixed'][t]['tok_s']:.1f} tok/s, {r['fixed'][t]['ttft_ms']:.0f} ms"
                               for t in range(1, cpus + 1))
            d = r["default"]
            lines.append(f"| {r['competitors']} | {r['loadavg_1m']:.2f} | {cells} | {d['tok_s']:.1f} tok/s, "
                         f"{d['ttft_ms']:.0f} ms ({'/'.join(map(str, d['chosen']))}) | {r['default_vs_best']:.2f} |")
    return "\n".join(lines) + "\n"


def run_args(args: argparse.Namespace) -> int:
    from ..errors import TrapetumError
    try:
        loads = [int(x) for x in args.loads.split(",") if x.strip()]
    except ValueError:
        raise TrapetumError(f"--loads: expected integers like 0,1,2, got {args.loads!r}") from None
    if args.repeats < 1 or args.tokens < 1 or any(n < 0 for n in loads):
        raise TrapetumError("--repeats and --tokens must be at least 1, --loads at least 0")
    out = Path(args.out)
    tree = Path(args.tree).resolve() if args.tree else TREE
    use_tree(tree)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cmd = " ".join(["trapetum bench cli"] + sys.argv[3:]) if sys.argv[1:3] == ["bench", "cli"] else "trapetum bench cli"
    res: dict = {"command": cmd, "date": time.strftime("%Y-%m-%d %H:%M %Z"), "cpus": cpus, "repeats": args.repeats,
                 "machine": f"{platform.node()} ({cpus} CPUs, {platform.processor() or platform.machine()}, "
                            f"Python {platform.python_version()})", "startup": {},
                 "tree": str(tree)}
    cbk = Path(args.cbk).resolve() if args.cbk else quick_cbk(out.resolve())
    tc = trapetum_cmd()
    for name, argv in (("trapetum --help", ["--help"]), ("trapetum generate --help", ["generate", "--help"]),
                       (f"trapetum info {cbk.name}", ["info", str(cbk)]), ("trapetum info", ["info"]),
                       (f"trapetum verify {cbk.name}", ["verify", str(cbk)])):
        timed(tc + argv)  # warm the page cache first
        res["startup"][name] = {"wall_s": round(median_time(tc + argv, args.repeats), 3),
                                "loadavg_1m": round(load_avg(), 2)}
        print(name, res["startup"][name], flush=True)
    first = ["generate", "--chat", QUESTION, "--max-new-tokens", "48"]
    la = load_avg()
    wall, r = timed(tc + first)
    res["first_command"] = {"command": "trapetum " + " ".join(first[:2]) + f' "{QUESTION}" ' + " ".join(first[3:]),
                            "wall_s": round(wall, 2), "loadavg_1m": round(la, 2), "answer": r.stdout.strip()}
    print(res["first_command"], flush=True)
    if not args.skip_threads:
        res["threads"] = thread_table(loads, args.nice, args.repeats, args.tokens, cpus)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cli.json").write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res)
    (out / "cli.md").write_text(md)
    print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trapetum.eval.bench_cli", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
