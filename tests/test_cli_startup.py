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
            "['quantize', '--help'], ['bench', '--help']):\n"
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
