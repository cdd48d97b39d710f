"""Quality at equal size against llama.cpp's quantizers: one command for the QUALITY.md table (issue 23).

    python scripts/bench_quality.py --model SmolLM2-135M=PATH.gguf [--model NAME=PATH ...] \
        --llama-bin /tmp/llamacpp-b11312/build/bin [--sources raw,fair] [--windows 30] [--all-windows] \
        [--ours NAME=QUANTIZE_FLAGS ...] [--llama Q4_0,Q4_K_M,...] [--imatrix both|on|off] \
        [--device cuda] [--out out/bench-quality] [--reuse] [--write-quality QUALITY.md]

For every model and source it builds the files and measures them with one harness:

* sources: ``raw`` = the GGUF as given (its weights sit on the file's quantization grid: a block format can
  re-express that grid, a per-row codebook cannot; the caveat goes with the table); ``fair`` = ``trapetum rotate``
  of it (norms folded, residual / value heads / MLP units rotated: same function, no grid), an fp16 GGUF that
  both quantizers start from. The reference row of each source is that source, dequantized, in fp32.
* ours: ``trapetum quantize SRC -o F.cbk FLAGS`` for each ``--ours NAME=FLAGS`` (``{calib}`` in FLAGS is the
  calibration file), so new quantizer options are benchmarked by naming their flags, no code change.
  Default: ``cb4`` (the 4-bit recipe) and ``aqlm2x8`` (``--scheme aqlm-2x8``).
* llama.cpp (``scripts/build_llamacpp_tools.sh``; benchmark only): ``llama-quantize`` to each ``--llama`` type,
  without and with an importance matrix from ``llama-imatrix`` on the same calibration text (32 chunks of 512
  tokens; ``--imatrix-chunks``); IQ2_XS-class types are refused by llama-quantize without one, and say so.
* measured, every file: size, bits per weight (layer projections: bytes of the stored projection tensors, their
  codebooks / scales included, over their weights; file: file bits over the source model's weights), perplexity
  with ``trapetum.eval.perplexity`` (fp32 reference decoder on the CPU or CUDA, non-overlapping windows of
  ``--ctx`` tokens, no BOS, first N windows and optionally all), greedy agreement (4 prompts x 32 tokens: tokens
  equal to the source reference's greedy continuation before the first difference, summed). llama.cpp's files
  are read by our GGUF loader (``gguf`` dequantizes every type these produce); ``--cross-check TYPES`` also runs
  ``llama-perplexity`` on the reference and those files (its own protocol: BOS, second half of each chunk
  scored), for the ratio to the reference, as a check of the loader; ``--cross-check ''`` runs none, the
  reference's included, and then ``llama-perplexity`` need not be built.

The calibration text must not be the evaluation text (refused by path and by content). Results go to
OUT/results.json (incremental; ``--reuse`` keeps finished rows and files) and OUT/quality.md; ``--write-quality
FILE`` puts the tables between the bench_quality markers of FILE (appended under a heading when absent).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATA = ROOT.parent / "shared" / "data"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three most important inventions of the twentieth century are"]
GREEDY_TOKENS = 32
DEFAULT_OURS = ["cb4=--bits 4 --calib {calib}",
                # the fair source's head is untied (the folded final norm): its embedding at 4 bits, not fp16
                "cb4e4@fair=--bits 4 --embed-bits 4 --calib {calib}",
                "aqlm2x8=--scheme aqlm-2x8 --calib {calib}"]
DEFAULT_LLAMA = "Q4_0,Q4_K_M,IQ4_XS,Q3_K_M,Q2_K,IQ2_XS"
NEEDS_IMATRIX = {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "Q2_K_S"}
GGUF_PROJ = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
START, END = "<!-- bench_quality:start -->", "<!-- bench_quality:end -->"


class BenchError(Exception):
    """A user error: printed as one line, exit 2."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def check_calibration(calib: Path, text: Path) -> None:
    """Calibration never sees the evaluation text: refused when it is the same file or the same content, or when
    it contains the evaluation text's opening."""
    for p, flag in ((calib, "--calib"), (text, "--text")):
        if not p.is_file():
            raise BenchError(f"{flag} {p}: file not found")
    if calib.resolve() == text.resolve() or sha256(calib) == sha256(text):
        raise BenchError(f"--calib {calib} is the evaluation text {text}: calibrate on other text")
    head = text.read_text(encoding="utf-8", errors="replace")[:2000].strip()
    if head and head in calib.read_text(encoding="utf-8", errors="replace"):
        raise BenchError(f"--calib {calib} contains the opening of the evaluation text {text}")


def parse_named(specs: list[str], flag: str) -> list[tuple[str, str]]:
    """NAME=VALUE pairs (NAME may end in @raw or @fair: that source only)."""
    out = []
    for s in specs:
        name, sep, rest = s.partition("=")
        stem, at, only = name.partition("@")
        if not sep or not stem or not stem.replace("_", "").replace("-", "").isalnum() or \
                (at and only not in ("raw", "fair")):
            raise BenchError(f"{flag} {s!r}: expected NAME=VALUE (NAME letters, digits, - and _, "
                             "optionally @raw or @fair)")
        if name in (n for n, _ in out):
            raise BenchError(f"{flag}: {name!r} given twice")
        out.append((name, rest))
    return out


def run_cmd(cmd: list[str], what: str, log_path: Path, env: dict | None = None) -> str:
    log(f"{what}: {' '.join(shlex.quote(c) for c in cmd)}")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(f"$ {shlex.join(cmd)}\n# rc {r.returncode}, {time.perf_counter() - t0:.1f} s\n"
                        f"--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}")
    if r.returncode != 0:
        tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])[:300]
        raise RuntimeError(f"{what} failed (rc {r.returncode}; log {log_path}): {tail}")
    return r.stdout + r.stderr


# -- bits per weight --------------------------------------------------------------------------------
def proj_weights(cfg) -> int:
    from trapetum.models.schema import expected_shapes
    return sum(math.prod(s) for n, s in expected_shapes(cfg).items()
               if n.startswith("model.layers.") and n.endswith("_proj.weight"))


def source_weights(ckpt) -> int:
    """Weights of the original model (each stored matrix once; the reference of the 'file' bits per weight)."""
    shapes = getattr(ckpt.tensors, "shapes", {}) or {}
    return sum(math.prod(s) for s in shapes.values())


def proj_bytes(path: Path) -> int:
    """Bytes of the stored layer projections (every tensor of each: codes, codebooks, scales)."""
    if path.suffix == ".gguf":
        from trapetum.formats.gguf import open_gguf
        return sum(t.n_bytes for t in open_gguf(path).tensors
                   if t.name.startswith("blk.") and t.name.split(".")[2] in GGUF_PROJ and t.name.endswith(".weight"))
    from trapetum.formats.cbk import CbkFile
    cbk = CbkFile(path)
    return sum(t.end - t.begin for n, t in cbk.tensors_table.items()
               if n.startswith("model.layers.") and any(f".{p}." in n or n.endswith(f".{p}") for p in
                                                        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj")))


# -- measurement ----------------------------------------------------------------------------------------
def measure(path: Path, args, text: Path, ref_greedy: list[list[int]] | None) -> dict:
    import torch

    from trapetum.eval.perplexity import agreement, greedy_tokens, perplexity, tokenize_file
    from trapetum.formats.detect import load_checkpoint
    from trapetum.models.decoder import Decoder

    ck = load_checkpoint(path)
    t0 = time.perf_counter()
    dec = Decoder.from_checkpoint(ck, dtype=torch.float32, device=args.device).eval()
    ids = tokenize_file(ck.tokenizer, text)
    if args.all_windows:  # one pass: every window scores ctx - 1 tokens, so the first N's NLL is their mean
        ra = perplexity(dec, ids, args.ctx, None, progress=False)
        per = ra.nll_per_window[:args.windows]
        nll = sum(per) / len(per)
        res = {"ppl": math.exp(nll), "nll": nll, "tokens": len(per) * (args.ctx - 1), "windows": len(per),
               "nll_per_window": per, "ppl_all": ra.ppl, "windows_all": ra.windows, "tokens_all": ra.tokens}
    else:
        r = perplexity(dec, ids, args.ctx, args.windows, progress=False)
        res = {"ppl": r.ppl, "nll": r.nll, "tokens": r.tokens, "windows": r.windows,
               "nll_per_window": r.nll_per_window}
    outs = [greedy_tokens(dec, ck.tokenizer.encode(p), args.greedy_tokens) for p in PROMPTS]
    res["greedy"] = outs
    if ref_greedy is not None:
        res["agree"] = agreement(outs, ref_greedy)[0]
    res["measure_s"] = time.perf_counter() - t0
    res["file_bytes"] = path.stat().st_size
    res["proj_bpw"] = proj_bytes(path) * 8 / proj_weights(ck.config)
    return res


def llama_ppl(bin_dir: Path, path: Path, text: Path, args, log_path: Path) -> float:
    out = run_cmd([str(bin_dir / "llama-perplexity"), "-m", str(path), "-f", str(text), "-c", str(args.ctx),
                   "--chunks", str(args.windows or 1), "-t", str(args.threads)], f"llama-perplexity {path.name}",
                  log_path)
    for line in out.splitlines():
        if "Final estimate: PPL =" in line:
            return float(line.split("PPL =")[1].split()[0])
    raise RuntimeError(f"llama-perplexity {path}: no final estimate (log {log_path})")


# -- building the files -----------------------------------------------------------------------------
def build_fair(src: Path, out: Path, args) -> Path:
    if not (args.reuse and out.is_file()):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        run_cmd([sys.executable, "-m", "trapetum.cli", "rotate", str(src), "-o", str(out), "--seed",
                 str(args.seed)], "rotate", out.with_suffix(".log"), env)
    return out


def build_ours(src: Path, out: Path, flags: str, args) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "trapetum.cli", "quantize", str(src), "-o", str(out), "--quiet",
           *shlex.split(flags.replace("{calib}", str(args.calib)))]
    if "--device" not in cmd and args.quant_device:
        cmd += ["--device", args.quant_device]
    t0 = time.perf_counter()
    run_cmd(cmd, f"quantize {out.name}", out.with_suffix(".log"), env)
    return time.perf_counter() - t0


def build_imatrix(src: Path, out: Path, args) -> Path:
    if not (args.reuse and out.is_file()):
        run_cmd([str(args.llama_bin / "llama-imatrix"), "-m", str(src), "-f", str(args.calib), "-o", str(out),
                 "-c", "512", "--chunks", str(args.imatrix_chunks), "-t", str(args.threads)],
                f"imatrix {src.name}", out.with_suffix(".log"))
    return out


def build_llama(src: Path, out: Path, qtype: str, imatrix: Path | None, raw: bool, args) -> float:
    cmd = [str(args.llama_bin / "llama-quantize")]
    if raw:
        cmd.append("--allow-requantize")  # the raw source is already quantized
    if imatrix is not None:
        cmd += ["--imatrix", str(imatrix)]
    cmd += [str(src), str(out), qtype, str(args.threads)]
    t0 = time.perf_counter()
    run_cmd(cmd, f"llama-quantize {out.name}", out.with_suffix(".log"))
    return time.perf_counter() - t0


# -- driver -------------------------------------------------------------------------------------------
def variants(args, src_kind: str) -> list[dict]:
    """The rows of one source, in table order: (kind, name, spec)."""
    rows = [{"kind": "ref", "name": "reference"}]
    for name, flags in args.ours:
        stem, _, only = name.partition("@")
        if only in ("", src_kind):
            rows.append({"kind": "ours", "name": stem, "flags": flags})
    for qt in args.llama:
        for im in {"both": (False, True), "on": (True,), "off": (False,)}[args.imatrix]:
            rows.append({"kind": "llama", "name": f"{qt}{'-imat' if im else ''}", "qtype": qt, "imatrix": im})
    return rows


def run_source(model: str, src_kind: str, src: Path, args, results: dict, save) -> None:
    from trapetum.formats.detect import load_checkpoint

    d = args.out / model / src_kind
    d.mkdir(parents=True, exist_ok=True)
    base = build_fair(src, d / "source.gguf", args) if src_kind == "fair" else src
    key0 = f"{model}/{src_kind}"
    n_src = source_weights(load_checkpoint(src))  # the original model's weights (raw source), one denominator
    ref_greedy = None
    imatrix = None
    for v in variants(args, src_kind):
        key = f"{key0}/{v['name']}"
        old = results.get(key)
        if args.reuse and old and old.get("windows_req") == args.windows and (old.get("ppl_all") or
                                                                              not args.all_windows):
            if v["kind"] == "ref":
                ref_greedy = old["greedy"]
            continue
        row = {"model": model, "source": src_kind, **v, "windows_req": args.windows}
        try:
            if v["kind"] == "ref":
                path = base
            elif v["kind"] == "ours":
                path = d / f"{v['name']}.cbk"
                if not (args.reuse and path.is_file()):
                    row["quantize_s"] = build_ours(base, path, v["flags"], args)
            else:
                path = d / f"{v['name']}.gguf"
                if v["imatrix"] and imatrix is None:
                    imatrix = build_imatrix(base, d / "imatrix.gguf", args)
                if not v["imatrix"] and v["qtype"] in NEEDS_IMATRIX:
                    row["error"] = "llama-quantize refuses this type without an importance matrix"
                    results[key] = row
                    save()
                    continue
                if not (args.reuse and path.is_file()):
                    row["quantize_s"] = build_llama(base, path, v["qtype"], imatrix if v["imatrix"] else None,
                                                    src_kind == "raw", args)
            log(f"measure {key}")
            row.update(measure(path, args, args.text, ref_greedy))
            row["bpw_file"] = row["file_bytes"] * 8 / n_src
            if v["kind"] == "ref":
                ref_greedy = row["greedy"]
            if args.llama_bin and args.cross_check and (v["kind"] == "ref" or v.get("qtype") in args.cross_check):
                row["llama_ppl"] = llama_ppl(args.llama_bin, path, args.text, args, path.with_suffix(".ppl.log"))
        except RuntimeError as e:
            row["error"] = str(e)
            log(f"{key}: {e}")
        results[key] = row
        save()
        if "ppl" in row:
            log(f"{key}: PPL {row['ppl']:.3f}  {row['file_bytes'] / 1e6:.1f} MB  {row['proj_bpw']:.3f} bpw")


def fmt_table(results: dict, model: str, src_kind: str, args) -> str:
    types = DEFAULT_LLAMA.split(",")
    rows = sorted((r for k, r in results.items() if k.startswith(f"{model}/{src_kind}/")),
                  key=lambda r: (("ref", "ours", "llama").index(r["kind"]),
                                 types.index(r["qtype"]) if r.get("qtype") in types else len(types),
                                 bool(r.get("imatrix"))))
    ref = next((r for r in rows if r["kind"] == "ref" and "ppl" in r), None)
    w = ref["windows"] if ref else args.windows
    cross = any("llama_ppl" in r for r in rows)
    head = ("| file | size | bpw, layers | bpw, file | PPL, first " + f"{w} window{'s' if w != 1 else ''} | "
            "PPL, all windows | "
            "greedy agreement |" + (" llama-perplexity (ratio to its reference) |" if cross else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        label = {"ref": "reference (source, dequantized, fp32)",
                 "ours": f"Trapetum `{r['name']}` (`{r.get('flags', '').replace('{calib}', 'CALIB')}`)",
                 "llama": f"llama.cpp {r.get('qtype')}{' + imatrix' if r.get('imatrix') else ''}"}[r["kind"]]
        if "ppl" not in r:
            lines.append(f"| {label} | - | - | - | {r.get('error', 'not run')} | - | - |" + (" - |" if cross else ""))
            continue
        rel = f" ({(r['ppl'] / ref['ppl'] - 1) * 100:+.1f}%)" if ref and r is not ref else ""
        pa = f"{r['ppl_all']:.3f}" if "ppl_all" in r else "not run"
        ag = "-" if r["kind"] == "ref" else f"{r.get('agree', 0)}/{len(PROMPTS) * args.greedy_tokens}"
        line = (f"| {label} | {r['file_bytes'] / 1e6:.1f} MB | {r['proj_bpw']:.3f} | {r['bpw_file']:.3f} | "
                f"{r['ppl']:.3f}{rel} | {pa} | {ag} |")
        if cross:
            lp = r.get("llama_ppl")
            refl = ref.get("llama_ppl") if ref else None
            line += (f" {lp:.3f}" + (f" ({(lp / refl - 1) * 100:+.1f}%)" if refl and r is not ref else "") + " |"
                     if lp else " - |")
        lines.append(line)
    return "\n".join(lines)


def render(results: dict, args, models: list[tuple[str, Path]]) -> str:
    parts = []
    for model, path in models:
        for s in args.sources:
            rows = [k for k in results if k.startswith(f"{model}/{s}/")]
            if not rows:
                continue
            what = ("raw GGUF source (weights on the file's quantization grid: block formats can re-express it; "
                    "read with the grid caveat)" if s == "raw" else
                    "fair source (`trapetum rotate --seed {}`: same function, no source grid; fp16 GGUF)"
                    .format(args.seed))
            parts.append(f"#### {model}, {what}\n\n{fmt_table(results, model, s, args)}\n")
    return "\n".join(parts)


def write_quality(path: Path, body: str, header: str) -> None:
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    block = f"{START}\n{header}\n\n{body}\n{END}"
    if START in text and END in text:
        a, b = text.index(START), text.index(END) + len(END)
        text = text[:a] + block + text[b:]
    else:
        text = text.rstrip("\n") + "\n\n## Against llama.cpp at equal size (issue 23, scripts/bench_quality.py)\n\n" \
            + block + "\n"
    path.write_text(text, encoding="utf-8")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                   help="a GGUF model (repeatable; default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--text", type=Path, default=DATA / "wikitext-2-raw" / "wiki.test.raw")
    p.add_argument("--calib", type=Path, default=DATA / "tinyshakespeare" / "input.txt")
    p.add_argument("--sources", default="raw,fair", help="raw, fair or both (default raw,fair)")
    p.add_argument("--windows", type=int, default=30, help="first N windows (default 30)")
    p.add_argument("--all-windows", action="store_true", help="also every full window")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--ours", action="append", default=None, metavar="NAME=FLAGS",
                   help="a Trapetum scheme as `trapetum quantize` flags ({calib}: the calibration file; "
                        "NAME@raw / NAME@fair: one source only; '' for none); repeatable; default: "
                        f"{', '.join(repr(s) for s in DEFAULT_OURS)}")
    p.add_argument("--llama", default=DEFAULT_LLAMA, help=f"llama.cpp types (default {DEFAULT_LLAMA}); '' for none")
    p.add_argument("--imatrix", default="both", choices=["both", "on", "off"])
    p.add_argument("--imatrix-chunks", type=int, default=32)
    p.add_argument("--llama-bin", type=Path, default=None, help="directory of llama-quantize / llama-imatrix / "
                   "llama-perplexity (scripts/build_llamacpp_tools.sh)")
    p.add_argument("--cross-check", default="Q4_K_M", help="types also scored by llama-perplexity, beside the reference ('' for none, the reference's "
                        "included)")
    p.add_argument("--device", default="cpu", help="device of the perplexity harness (default cpu)")
    p.add_argument("--quant-device", default=None, help="--device for trapetum quantize (default: its own)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--greedy-tokens", type=int, default=GREEDY_TOKENS)
    p.add_argument("--seed", type=int, default=0, help="seed of the fair source's rotation")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "bench-quality")
    p.add_argument("--reuse", action="store_true", help="keep finished rows and built files of an earlier run")
    p.add_argument("--write-quality", type=Path, default=None, metavar="FILE")
    a = p.parse_args(argv)
    a.sources = [s for s in a.sources.split(",") if s]
    if not a.sources or set(a.sources) - {"raw", "fair"}:
        raise BenchError(f"--sources must name raw and/or fair, got {','.join(a.sources)!r}")
    a.ours = parse_named([o for o in (a.ours if a.ours is not None else DEFAULT_OURS) if o], "--ours")  # '': none
    a.llama = [t for t in a.llama.split(",") if t]
    a.cross_check = [t for t in a.cross_check.split(",") if t]
    if a.llama and a.llama_bin is None:
        raise BenchError("--llama-bin DIR is needed for the llama.cpp rows (bash scripts/build_llamacpp_tools.sh "
                         "builds them), or --llama ''")
    if a.llama_bin is not None:
        for tool in ("llama-quantize", "llama-imatrix") + (("llama-perplexity",) if a.cross_check else ()):
            if not (a.llama_bin / tool).is_file():
                raise BenchError(f"--llama-bin {a.llama_bin}: no {tool} (bash scripts/build_llamacpp_tools.sh)")
    if a.windows < 1:
        raise BenchError(f"--windows must be positive, got {a.windows}")
    check_calibration(a.calib, a.text)
    return a


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        models = []
        for name, path in parse_named(args.model, "--model"):
            if not Path(path).is_file():
                raise BenchError(f"--model {name}={path}: file not found")
            models.append((name, Path(path)))
        if not models:
            from trapetum.formats.gguf import default_model_path
            models = [("SmolLM2-135M-Instruct", Path(default_model_path()))]
    except BenchError as e:
        print(f"bench_quality: error: {e}", file=sys.stderr)
        return 2
    import torch
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    rpath = args.out / "results.json"
    results = json.loads(rpath.read_text()) if (args.reuse and rpath.is_file()) else {}

    def save():
        rpath.write_text(json.dumps(results, indent=1))
    t0 = time.perf_counter()
    for name, path in models:
        for s in args.sources:
            run_source(name, s, path, args, results, save)
    body = render(results, args, models)
    machine = f"{platform.node() or 'host'}: {os.cpu_count()} CPUs" + \
        (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "")
    header = (f"Command: `python scripts/bench_quality.py {shlex.join(sys.argv[1:] if argv is None else argv)}`  \n"
              f"Machine: {machine}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
              f"{time.perf_counter() - t0:.0f} s. Text {args.text.name}, windows of {args.ctx} tokens, no BOS; "
              f"calibration {args.calib.name}.")
    (args.out / "quality.md").write_text(header + "\n\n" + body)
    print(header + "\n\n" + body)
    if args.write_quality:
        write_quality(args.write_quality, body, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
