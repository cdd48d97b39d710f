"""Issue 22 (4): the CLI starts light. Building the parser (what `trapetum --help` does) imports neither torch nor
the server nor numpy; every command's --help still works (the heavy sub-parsers fill in when chosen).
The times themselves are measured by `trapetum bench cli` (BENCHMARKS.md), not here."""
import subprocess
import sys

import pytest

HEAVY = ("torch", "numpy", "fastapi", "uvicorn", "safetensors", "tokenizers", "gguf", "jinja2", "triton")


def test_importing_the_cli_imports_no_torch():
    code = ("import sys, trapetum.cli as c; c.build_parser().format_help(); "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"building the parser imported {r.stdout.strip()}"


def test_help_imports_no_torch():
    code = ("import sys, trapetum.cli as c\n"
            "for argv in (['--help'], ['generate', '--help'], ['chat', '--help'], ['serve', '--help'], "
            "['quantize', '--help'], ['bench', '--help'], ['info', '--help'], ['verify', '--help'], "
            "['bench', 'cpu', '--help'], ['bench', 'offload', '--help'], ['bench', 'cli', '--help']):\n"
            "    assert c.main(argv) == 0, argv\n"
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "", f"--help imported {r.stderr.strip()}"


@pytest.mark.parametrize("argv", [["bench", "load", "--help"], ["bench", "spec", "--help"], ["bench", "cli", "--help"],
                                  ["ppl", "--help"], ["info", "--help"], ["verify", "--help"]])
def test_every_help_works(argv, capsys):
    from trapetum import cli
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: trapetum " + " ".join(argv[:-1])), out[:200]


def test_lazy_subparser_arguments_parse(capsys):
    """bench load's arguments come from eval/loadbench.py when `bench load` is chosen; a bad value is one line."""
    from trapetum import cli
    assert cli.main(["bench", "load", "--clients", "1", "--max-tokens", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trapetum: error: argument --max-tokens"), err


LIGHT_MISSING = ("torch", "triton", "trapetum.models.decoder", "trapetum.runtime.engine", "trapetum.kernels.codebook_gemv")


@pytest.fixture(scope="module")
def quantized_cbk(tmp_path_factory):
    """A tiny llama quantized as `trapetum quantize` does (compact u8 / shared codebooks, version 2)."""
    from tests.tiny_models import build_cbk
    return build_cbk("llama3", tmp_path_factory.mktemp("startup"), iters=1)


def _embedded_gguf() -> str:
    from trapetum.formats.detect import default_model_path
    from trapetum.errors import FormatError
    try:
        return default_model_path()
    except FormatError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("argv", [["info", "CBK"], ["info", "--json", "CBK"], ["verify", "CBK"], ["info"],
                                  ["info", "GGUF"]])
def test_info_and_verify_import_no_torch(argv, quantized_cbk):
    """Issue 22: `info FILE.cbk`, `info` (the embedded GGUF), `info FILE.gguf` and `verify FILE.cbk` read headers
    with json / numpy / gguf: torch, triton and the decoder stay unimported (what made `info` take 2.3 s)."""
    if argv == ["info"] or "GGUF" in argv:
        gguf = _embedded_gguf()
    argv = [str(quantized_cbk) if a == "CBK" else gguf if a == "GGUF" else a for a in argv]
    code = ("import sys, io, contextlib, trapetum.cli as c\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            f"    rc = c.main({argv!r})\n"
            "assert rc == 0 and out.getvalue(), (rc, out.getvalue())\n"
            f"print(','.join(m for m in {LIGHT_MISSING!r} if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "", f"trapetum {' '.join(argv)} imported {r.stdout.strip()}"


def test_version_imports_nothing_heavy():
    code = ("import sys, io, contextlib, trapetum.cli as c\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    assert c.main(['--version']) == 0\n"
            "assert out.getvalue().startswith('trapetum '), out.getvalue()\n"
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"--version imported {r.stdout.strip()}"
