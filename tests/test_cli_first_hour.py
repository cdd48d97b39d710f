"""Issue 22: the first hour of a new user, item by item (the thread count: test_cli_threads.py; start-up:
test_cli_startup.py). Each user error is one line on stderr starting 'trapetum: error:', a non-zero exit, no
traceback."""
import os
import pty
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_bad_input import assert_user_error, cli
from tests.test_chat_terminal import read_until
from tests.tiny_models import build
from trapetum import cli as trapetum_cli


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama with a tokenizer and a chat template."""
    d = tmp_path_factory.mktemp("tiny")
    build("llama2", d, tokenizer=True)
    return d


def main(argv, capsys):
    code = trapetum_cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ 2. quantize checks before the work

def test_quantize_checks_the_output_first(tmp_path):
    """`quantize SRC -o /no/such/dir/out.cbk` fails at once (no calibration ran), naming -o and the directory."""
    from trapetum.formats.detect import default_model_path
    src = default_model_path()
    t0 = time.perf_counter()
    r = cli("quantize", src, "-o", "/no/such/dir/out.cbk")
    assert_user_error(r, "-o /no/such/dir/out.cbk", "the directory /no/such/dir does not exist")
    assert r.returncode == 1 and time.perf_counter() - t0 < 60
    assert_user_error(cli("quantize", src, "-o", tmp_path), "is a directory")
    assert_user_error(cli("quantize", src, "-o", tmp_path / "o.cbk", "--calib", tmp_path / "nope.txt"),
                      "--calib", "nope.txt", "file not found")
    assert not list(tmp_path.iterdir())


def test_check_output_path_space(tmp_path):
    from trapetum.errors import TrapetumError
    from trapetum.formats.cbk_write import check_output_path
    assert check_output_path(tmp_path / "a.cbk", 1) == tmp_path / "a.cbk"
    with pytest.raises(TrapetumError, match=r"-o .*a\.cbk: the file will be about .* MB free"):
        check_output_path(tmp_path / "a.cbk", 1 << 60, flag="-o")
    assert not list(tmp_path.iterdir())  # the probe file is gone


def test_planned_bytes_match_the_file(tmp_path):
    """The disk-space check's estimate is near the size of the file written."""
    from trapetum.formats.detect import load_checkpoint
    from trapetum.quant.quantize import Recipe, plan_quantization, planned_bytes, quantize_to_cbk
    build("llama2", tmp_path / "src")
    recipe = Recipe(bits=4, head_bits=8, weighted=False, iters=2).validate()
    plan = plan_quantization(load_checkpoint(str(tmp_path / "src")), recipe)
    out, _ = quantize_to_cbk(str(tmp_path / "src"), tmp_path / "m.cbk", recipe, progress=False, log=lambda s: None)
    size = Path(out).stat().st_size
    assert 0.9 * size <= planned_bytes(plan) <= 1.5 * size + (1 << 20), (planned_bytes(plan), size)


# ------------------------------------------------------------------ 3. arguments

def _answer(argv, capsys):
    code, out, err = main(argv, capsys)
    assert code == 0, err
    return out


def test_options_anywhere_and_short_flags(tiny, capsys):
    base = _answer(["generate", tiny, "hello there", "--max-new-tokens", "4", "--temperature", "0",
                    "--threads", "1"], capsys)
    assert base.startswith("hello there") and len(base) > len("hello there")
    for argv in (["generate", tiny, "--max-new-tokens", "4", "hello there", "--temperature", "0", "-t", "1"],
                 ["generate", "-n", "4", tiny, "--temp", "0", "hello there", "-t", "1"],
                 ["generate", "-m", tiny, "-p", "hello there", "-n", "4", "--temperature", "0", "-t", "1", "-c", "64"],
                 ["generate", "--temperature", "0", "-t", "1", "-n", "4", "-m", tiny, "hello there"]):
        assert _answer(argv, capsys) == base, argv
    chat = _answer(["generate", tiny, "--chat", "question", "-n", "3", "--temperature", "0", "-t", "1"], capsys)
    assert chat.strip()


def test_prompt_from_a_file_and_stdin(tiny, tmp_path, capsys):
    base = _answer(["generate", tiny, "hello there", "-n", "3", "--temperature", "0", "-t", "1"], capsys)
    f = tmp_path / "prompt.txt"
    f.write_text("hello there\n")
    assert _answer(["generate", tiny, "-f", f, "-n", "3", "--temperature", "0", "-t", "1"], capsys) == base
    r = subprocess.run([sys.executable, "-m", "trapetum.cli", "generate", str(tiny), "-", "-n", "3",
                        "--temperature", "0", "-t", "1"], input="hello there\n", capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout == base, r.stderr


@pytest.mark.parametrize("argv,fragments", [
    (["generate", "a", "b"], ["'a' is not a model file or directory", "-p TEXT"]),
    (["generate", "a", "b", "c"], ["generate takes [MODEL] PROMPT"]),
    (["generate"], ["no prompt"]),
    (["generate", "-p", "x", "-f", "y"], ["give the prompt once"]),
    (["generate", "-f", "/no/such/prompt.txt"], ["-f /no/such/prompt.txt: cannot read"]),
    (["generate", "x", "-n", "many"], ["argument -n/--max-new-tokens: invalid int value"]),
    (["generate", "x", "--top-p", "1.5"], ["--top-p: must be in (0, 1], got 1.5"]),
    (["generate", "x", "--max-new-tokens", "-1"], ["--max-new-tokens"]),
    (["generate", "x", "--ctx", "0"], ["--ctx must be at least 1"]),
    (["generate", "x", "--threads", "0"], ["--threads must be at least 1"]),
    (["chat", "m1", "-m", "m2"], ["give the model once"]),
])
def test_argument_errors(argv, fragments, capsys):
    code, out, err = main(argv, capsys)
    assert code in (1, 2) and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trapetum: error:"), err
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def test_ctx_limits_the_context(tiny, capsys):
    code, _, err = main(["generate", tiny, "hello there " * 20, "-n", "4", "-c", "8", "-t", "1"], capsys)
    assert code == 1 and err.startswith("trapetum: error:") and "context" in err, err


def test_chat_in_a_pty_with_options_after_the_model(tiny):
    """Typed as a user would: `trapetum chat MODEL --temperature 0 -n 4`, then /help, /settings, /set, /system."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "trapetum.cli", "chat", str(tiny), "--temperature", "0", "-n", "4",
                             "-t", "1"], stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    try:
        banner = read_until(master, b"> ", 120)
        assert b"trapetum chat" in banner and b"/help" in banner, banner
        assert b"loading " + str(tiny).encode() + b" on cpu (1 thread) ... " in banner, banner  # item 7
        os.write(master, b"/help\r")
        assert b"/set NAME VALUE" in read_until(master, b"/exit, /quit", 30)
        os.write(master, b"/set temperature 0.5\r")
        assert b"temperature 0.5," in read_until(master, b"seed random", 30)
        os.write(master, b"/set top_p 2\r")
        assert b"trapetum: error: /set top_p: must be in (0, 1]" in read_until(master, b"got 2", 30)
        os.write(master, b"/system be brief\r")
        assert b"system prompt set" in read_until(master, b"cleared)", 30)
        os.write(master, b"hello\r")
        read_until(master, b"\r\n> ", 60)
        os.write(master, b"/exit\r")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


# ------------------------------------------------------------------ 5. server defaults

class _Recording:
    """A FakeModel that keeps the settings of its last request, with a generation config."""

    def __init__(self, generation):
        from tests.serve_fixtures import FakeModel
        self.model = FakeModel(name="rec")
        self.model.checkpoint = type("C", (), {"generation": generation})()
        self.seen = []
        inner = self.model.stream

        def stream(prompt, settings=None, *, cancel=None, **kw):
            self.seen.append(kw)
            return inner(prompt, settings, cancel=cancel, **kw)
        self.model.stream = stream


@pytest.mark.parametrize("generation,serve_opts,request_fields,want", [
    ({}, {}, {}, {"temperature": 0.7}),
    ({"temperature": 0.3, "top_p": 0.9, "top_k": 20}, {}, {}, {"temperature": 0.3, "top_p": 0.9, "top_k": 20}),
    ({"temperature": 0.3, "top_p": 0.9}, {"temperature": 0.1}, {}, {"temperature": 0.1, "top_p": 0.9}),
    ({"temperature": 0.3}, {"temperature": 0.1}, {"temperature": 0}, {"temperature": 0.0}),
    ({"temperature": "hot", "top_p": 7}, {}, {}, {"temperature": 0.7}),   # invalid model values are ignored
])
def test_server_sampling_defaults(generation, serve_opts, request_fields, want):
    from starlette.testclient import TestClient

    from trapetum.serve.server import ModelSpec, create_app
    rec = _Recording(generation)
    with TestClient(create_app([ModelSpec(loader=lambda: rec.model)], sampling=serve_opts)) as c:
        for _ in range(100):
            if c.get("/health").status_code == 200:
                break
            time.sleep(0.05)
        r = c.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2, **request_fields})
        assert r.status_code == 200, r.text
        info = c.get("/v1/models").json()["data"][0]["info"]
    got = {k: v for k, v in rec.seen[-1].items() if k in ("temperature", "top_p", "top_k", "min_p")}
    assert got == want
    assert info["sampling_defaults"]["temperature"]["value"] == {**{"temperature": 0.7}, **{
        k: v for k, v in generation.items() if k == "temperature" and isinstance(v, float)}, **serve_opts}[
        "temperature"]


def test_serve_sampling_flags_are_checked(capsys):
    code, _, err = main(["serve", "--temperature", "5"], capsys)
    assert code == 1 and err.strip() == "trapetum: error: --temperature must be in [0, 2], got 5", err
    code, _, err = main(["serve", "--top-p", "0"], capsys)
    assert code == 1 and "--top-p must be in (0, 1]" in err, err


# ------------------------------------------------------------------ 6. messages

def test_verify_on_a_gguf_says_what_it_is():
    from trapetum.formats.detect import default_model_path
    r = cli("verify", default_model_path())
    assert_user_error(r, "not a .cbk file: it is a GGUF file")
    assert r.returncode == 1 and not r.stdout


def test_verify_on_random_bytes(tmp_path):
    # Seeded bytes: os.urandom put a '{' after the length word once in 256 runs, which reads
    # as a truncated safetensors header (the next test) and failed CI once.
    junk = bytearray(random.Random(0).randbytes(4096))
    junk[8] = ord("x")
    f = tmp_path / "junk.cbk"
    f.write_bytes(bytes(junk))
    assert_user_error(cli("verify", f), "junk.cbk", "not a .cbk file")


def test_verify_on_random_bytes_after_a_brace_says_truncated(tmp_path):
    junk = bytearray(random.Random(1).randbytes(4096))
    junk[8] = ord("{")
    f = tmp_path / "junk.cbk"
    f.write_bytes(bytes(junk))
    assert_user_error(cli("verify", f), "junk.cbk", "is larger than the rest of the file", "truncated?")


def test_serve_on_a_busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    try:
        r = cli("serve", "--port", port, timeout=120)
    finally:
        s.close()
    assert_user_error(r, f"--port {port}", "already in use")
    assert "serving on" not in r.stdout


def test_help_says_the_defaults_and_agrees_with_the_errors(capsys, tmp_path):
    from trapetum.formats.detect import default_model_path
    from trapetum.quant.quantize import bits_choices
    code, out, _ = main(["generate", "--help"], capsys)
    assert code == 0
    flat = " ".join(out.split())
    for text in ("-n N, --max-new-tokens N", "(default 256)", "0 = greedy (default 0.0)", "nucleus sampling, 1 = off (default 1.0)",
                 "-m MODEL, --model MODEL", "-p TEXT, --prompt TEXT", "-f FILE, --file FILE", "-c N, --ctx N",
                 "-t N, --threads N"):
        assert text in flat, text
    code, out, _ = main(["quantize", "--help"], capsys)
    flat = " ".join(out.split())
    assert f"({bits_choices()}; default 4)" in flat and "cuda when a GPU is present" in flat
    assert ("an untied one gets an 8-bit codebook when its source stores the embedding at 8 bits or fewer (a "
            "quantized GGUF), else keeps it fp16") in flat  # what --embed-bits auto does
    readme = " ".join((Path(__file__).parent.parent / "README.md").read_text().replace("#", " ").split())
    assert "--embed-bits auto (default): a tied embedding shares the head's table; an untied one is 8-bit" in readme
    code, _, err = main(["quantize", default_model_path(), "-o", tmp_path / "y.cbk", "--bits", "5"], capsys)
    assert code == 1 and f"--bits must be {bits_choices()}, got 5" in err, err
    code, out, _ = main(["bench", "e2e", "--help"], capsys)
    flat = " ".join(out.split())
    assert "--out DIR directory for results.json" in flat and "--models SHAPE,..." in flat
    code, out, _ = main(["bench", "quantize", "--help"], capsys)
    assert "scalar" in out and "cb4" in out
    code, _, err = main(["bench", "quantize", "--scheme", "cb5"], capsys)
    assert code == 1 and "--scheme: unknown scheme 'cb5'" in err, err


# ------------------------------------------------------------------ 7. progress

def test_quantize_says_what_it_does_after_the_bar(tmp_path):
    build("llama2", tmp_path / "src")
    r = cli("quantize", tmp_path / "src", "-o", tmp_path / "m.cbk", "--calib", "none", "--iters", "2", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "writing " in r.stderr and "m.cbk" in r.stderr, r.stderr[-2000:]


# ------------------------------------------------------------------ 8. an already quantized source

def test_already_quantized_source_warns():
    from trapetum.formats.detect import default_model_path, load_checkpoint
    from trapetum.quant.source_bits import already_quantized, nominal_bits
    assert [nominal_bits(f) for f in ("Q4_1", "Q4_K", "Q8_0", "IQ2_XS", "F16", "BF16", "F32")] == [4, 4, 8, 2, None,
                                                                                                   None, None]
    formats = load_checkpoint(str(default_model_path())).tensor_formats()  # the embedded Q4_1 GGUF
    w = already_quantized(formats, 4)
    assert w and "Q4_1 x210 of 210 projections" in w, w
    assert already_quantized(formats, 3) is None
    assert already_quantized({"model.layers.0.mlp.up_proj.weight": "F16"}, 4) is None


def test_a_file_larger_than_its_source_warns(tmp_path):
    """The plan is compared with the source before the work."""
    from trapetum.quant.source_bits import larger_than_source, source_bytes
    w = larger_than_source(600_000_000, 491_400_064, embed_dense=True)
    assert w == ("warning: the .cbk will be about 600.0 MB, larger than its 491.4 MB source; the embedding stays "
                 "fp16 (--embed-bits auto keeps an untied fp16/bf16/fp32 source's); --embed-bits 8 stores it as an "
                 "8-bit codebook")
    assert "--target-size" in larger_than_source(2, 1, embed_dense=False)
    assert larger_than_source(1, 1, embed_dense=True) is None and larger_than_source(5, None, embed_dense=True) is None
    (tmp_path / "m.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "config.json").write_bytes(b"{}" * 50)
    assert source_bytes(str(tmp_path / "m.safetensors")) == 10 and source_bytes(str(tmp_path)) == 10
    assert source_bytes(str(tmp_path / "nope")) is None


def test_auto_embed_bits_follows_the_stored_format():
    """``--embed-bits auto``: tied -> the head's bits; untied -> 8 from a quantized GGUF type, fp16 otherwise."""
    from trapetum.quant.source_bits import auto_embed_bits
    assert [auto_embed_bits(False, 8, f) for f in ("Q5_0", "Q8_0", "Q4_K", "IQ2_XS", "Q6_K")] == [8] * 5
    assert [auto_embed_bits(False, 8, f) for f in ("F16", "BF16", "F32", "codebook-8bit", None)] == [None] * 5
    assert auto_embed_bits(True, 8, "Q5_0") == 8 and auto_embed_bits(True, None, "F16") is None
    assert auto_embed_bits(False, None, "Q8_0") == 8  # an fp16 head does not change the embedding's choice


def test_qwen_default_plan_is_smaller_than_its_source():
    """Qwen2.5-Coder-0.5B (untied, Q5_0 embedding): the default plan stores the embedding as the --embed-bits 8
    codebook (an fp16 table made ~594 MB of a 491 MB GGUF), so it is the same plan and under the source; forcing
    fp16 still warns (QUALITY.md, session 10)."""
    from tests.real_models import require
    from trapetum.quant.source_bits import larger_than_source, source_bytes
    from trapetum.formats.detect import load_checkpoint
    from trapetum.quant.quantize import Recipe, plan_quantization, planned_bytes
    ck = load_checkpoint(str(require("qwen25")))  # lazy: the plan reads shapes and formats only
    assert ck.tensor_formats()["model.embed_tokens.weight"] == "Q5_0" and not ck.config.tie_word_embeddings
    plans = {eb: plan_quantization(ck, Recipe(embed_bits=eb).validate()) for eb in ("auto", 8, None)}
    size = {eb: planned_bytes(p) for eb, p in plans.items()}
    src = source_bytes(ck.source)
    assert size["auto"] == size[8] < src < size[None], (size, src)
    assert plans["auto"].quantized["model.embed_tokens.weight"] == plans[8].quantized["model.embed_tokens.weight"]
    assert sorted(plans["auto"].dense) == sorted(plans[8].dense)
    assert larger_than_source(size["auto"], src, embed_dense=False) is None
    w = larger_than_source(size[None], src, embed_dense="model.embed_tokens.weight" not in plans[None].quantized)
    assert w and "--embed-bits 8" in w, w


def test_stats_line_says_the_threads_and_bench_cli_reads_it(tiny, capsys):
    from trapetum.eval.bench_cli import STATS
    code, _, err = main(["generate", tiny, "hi", "-n", "2", "--stats", "-t", "1"], capsys)
    m = STATS.search(err)
    assert code == 0 and m and m.group(4) == "1" and m.group(5) == "--threads", err


# ------------------------------------------------------------------ 4. --gptq by default where it costs seconds

@pytest.mark.parametrize("argv, device, want", [
    ([], "cpu", False), ([], "cuda", True), ([], "cuda:1", True),
    (["--gptq"], "cpu", True), (["--no-gptq"], "cuda", False),
    (["--calib", "none"], "cuda", False), (["--codebook", "shared"], "cuda", False),
])
def test_gptq_default_follows_the_device(argv, device, want, monkeypatch, tmp_path, capsys):
    """QUALITY.md "Session 14": GPTQ's files are 3-10% better at the same size for seconds more on the H200, and take
    minutes more on the CPU, so the default is on for CUDA only (with calibration and per-row codebooks)."""
    from trapetum.quant import quantize as qmod
    seen = []

    def fake(src, out, recipe, device, **kw):
        seen.append((device, recipe.gptq))
        raise SystemExit(0)

    monkeypatch.setattr(qmod, "quantize_to_cbk", fake)
    src, calib = tmp_path / "src.gguf", tmp_path / "calib.txt"
    src.write_bytes(b"x")
    calib.write_text("some calibration text\n")
    if "--calib" not in argv:
        argv = argv + ["--calib", calib]
    with pytest.raises(SystemExit):
        trapetum_cli.main([str(a) for a in ["quantize", src, "-o", tmp_path / "o.cbk", "--device", device, *argv]])
    assert seen == [(device, want)], capsys.readouterr().err
