"""Perplexity harness: window protocol, prefill == token-by-token decode NLL, CLI line."""
from __future__ import annotations

import math
import re

import pytest
import torch

import trapetum
from trapetum.errors import TrapetumError
from trapetum.eval.perplexity import agreement, greedy_tokens, make_windows, perplexity, window_nll

from test_quantize import _tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = _tiny_llama(tmp_path_factory.mktemp("ppl"), tie=True)
    return d, trapetum.load(str(d))


def test_windows_protocol():
    ids = torch.arange(10)
    w = make_windows(ids, 4)
    assert w.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]  # non-overlapping, tail dropped
    assert make_windows(ids, 4, windows=1).shape == (1, 4)
    wb = make_windows(ids, 4, bos_id=99)
    assert wb.tolist() == [[99, 0, 1, 2], [99, 3, 4, 5], [99, 6, 7, 8]]
    with pytest.raises(TrapetumError):
        make_windows(ids, 11)
    with pytest.raises(TrapetumError):
        make_windows(ids, 1)


def test_prefill_equals_decode_fp32(tiny):
    _, m = tiny
    ids = torch.randint(3, 96, (3 * 40 + 5,), generator=torch.Generator().manual_seed(0))
    a = perplexity(m.decoder, ids, ctx=40, windows=None, progress=False)
    b = perplexity(m.decoder, ids, ctx=40, windows=None, decode=True, progress=False)
    assert a.tokens == b.tokens == 3 * 39 and a.windows == 3
    assert abs(a.nll - b.nll) < 1e-4
    assert max(abs(x - y) for x, y in zip(a.nll_per_window, b.nll_per_window)) < 1e-4
    # the NLL is the mean of -log softmax at every predicted position
    w = ids[:40].view(1, -1)
    with torch.inference_mode():
        lp = torch.log_softmax(m.decoder(w)[0, :-1].double(), -1)
    ref = -lp.gather(1, w[0, 1:, None]).sum().item()
    s, n = window_nll(m.decoder, ids[:40])
    assert n == 39 and abs(s - ref) < 1e-3
    assert a.line().startswith(f"PPL {math.exp(a.nll):.2f}  NLL {a.nll:.4f}  117 tokens  3 windows x 40")


def test_greedy_tokens_and_agreement(tiny):
    _, m = tiny
    ids = [5, 17, 33, 8]
    got = greedy_tokens(m.decoder, ids, 6)
    with torch.inference_mode():  # the same continuation through full forwards of the growing sequence
        seq = list(ids)
        for _ in range(6):
            seq.append(int(m.decoder(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[len(ids):]
    assert agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]]) == (4, 5)
    assert agreement([[7, 2]], [[1, 2]]) == (0, 2)  # nothing counts after the first difference


def test_cli_ppl(tiny, tmp_path, capsys):
    d, _ = tiny
    txt = tmp_path / "t.txt"
    txt.write_text(" ".join(f"t{i % 90 + 3}" for i in range(200)))
    from trapetum.cli import main

    assert main(["ppl", str(d), "--text", str(txt), "--ctx", "32", "--windows", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^PPL \d+\.\d\d  NLL \d\.\d{4}  62 tokens  2 windows x 32$", out, re.M), out
    assert main(["ppl", str(d), "--text", str(txt), "--windows", "zero"]) == 1
    assert main(["ppl", str(d), "--text", str(tmp_path / "missing.txt")]) == 1
