"""Activation sparsity (TEAL; models/sparsity.py, quant/sparsify.py): thresholds from calibration, the .cbk section
and side file (schema checked as hostile), the runtime option on the reference decoder and the engine (CPU
fallbacks): position 0 dense, VERIFY rows bitwise the decode steps, the option off bitwise the dense path."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trapetum
from tests.cbk_helpers import tiny_model, tiny_tokenizer
from tests.tiny_models import build
from trapetum.errors import FormatError, TrapetumError
from trapetum.eval.verify_exact import check
from trapetum.formats.cbk import open_cbk
from trapetum.formats.cbk_write import rewrite_with_sparsity, write_cbk
from trapetum.models.batch import Mode
from trapetum.models.sparsity import SITES, SiteThresholds, SparsityTable, read_side_file, uniform
from trapetum.quant.sparsify import parse_targets, threshold_of, write_side_file
from trapetum.runtime.engine import GpuEngine

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("torch_fallbacks")  # tests/conftest.py
TEXT = " ".join(f"the cat sat on the mat number {i} and then {i * 7 % 13} dogs ran" for i in range(400))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama3")
    build("llama3", d, tokenizer=True)
    return d


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    p = tmp_path_factory.mktemp("calib") / "calib.txt"
    p.write_text(TEXT)
    return p


def ids(n, seed=0):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def table_for(m, t: float) -> SparsityTable:
    return uniform(m.config.num_layers, t)


# -- thresholds --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 3, 53, 97, 257, 10_000])
@pytest.mark.parametrize("s", [0.0, 0.1, 0.25, 0.5, 0.9])
def test_threshold_zeroes_floor_s_n_values(n, s):
    v = torch.rand(n, generator=torch.Generator().manual_seed(n)) + 1e-3  # distinct, positive
    t = threshold_of(v, s)
    assert int((v <= t).sum()) == int(s * n)


def test_parse_targets():
    assert parse_targets(0.25) == {s: 0.25 for s in SITES}
    got = parse_targets(0.25, "q=0.3, o=0.5,gate=0.2,down=0.6")
    assert got == {"qkv": 0.3, "o": 0.5, "gate_up": 0.2, "down": 0.6}
    assert parse_targets(0.1, {"up": 0.4})["gate_up"] == 0.4
    for bad in ("x=0.3", "q=1.0", "q=-0.1", "q", "q=abc"):
        with pytest.raises(TrapetumError, match="--site"):
            parse_targets(0.25, bad)
    with pytest.raises(TrapetumError, match="--sparsity"):
        parse_targets(1.5)


# -- the reference decoder ----------------------------------------------------------------------------------
def test_option_off_is_bitwise_the_dense_path(hf):
    dense = trapetum.load(hf)
    a = dense.logits(ids(24))
    assert torch.equal(trapetum.load(hf, sparsity=None).logits(ids(24)), a)
    assert torch.equal(trapetum.load(hf, sparsity="off").logits(ids(24)), a)
    m = trapetum.load(hf, sparsity=table_for(dense, 0.05))
    on = m.logits(ids(24))
    assert not torch.equal(on, a)
    m.decoder.set_sparsity(None)  # back to dense: nothing left behind
    assert torch.equal(m.logits(ids(24)), a)


def test_zero_threshold_equals_dense(hf):
    """t = 0 keeps every nonzero: the sparsify op runs, the logits are the dense ones."""
    dense = trapetum.load(hf).logits(ids(20))
    assert torch.equal(trapetum.load(hf, sparsity=table_for(trapetum.load(hf), 0.0)).logits(ids(20)), dense)


def layer0_inputs(m, tokens):
    """Layer 0's site inputs [T, F] of one forward."""
    seen, L0 = {}, m.decoder.model.layers[0]
    mods = {"qkv": L0.self_attn.q_proj, "o": L0.self_attn.o_proj, "gate_up": L0.mlp.gate_proj,
            "down": L0.mlp.down_proj}
    hooks = [mod.register_forward_pre_hook(lambda mod, a, site=site: seen.__setitem__(site, a[0][0].clone()))
             for site, mod in mods.items()]
    m.logits(tokens)
    for h in hooks:
        h.remove()
    return seen


def test_inputs_are_thresholded_and_position_zero_stays_dense(hf):
    t = 0.05
    dense = layer0_inputs(trapetum.load(hf), ids(16))
    sparse = layer0_inputs(trapetum.load(hf, sparsity=table_for(trapetum.load(hf), t)), ids(16))
    # layer 0's qkv input is the dense model's, thresholded on rows 1.. (row 0 as it is)
    d = dense["qkv"]
    want = torch.where(d.abs() > t, d, torch.zeros(()))
    want[0] = d[0]
    assert torch.equal(sparse["qkv"], want)
    assert (d[0].abs() <= t).any() and (sparse["qkv"][1:] == 0).any()
    # attention at position 0 sees only its own (dense) row: the o input's row 0 is the dense model's
    assert torch.equal(sparse["o"][0], dense["o"][0])
    for site, x in sparse.items():
        rest = x[1:]
        assert ((rest == 0) | (rest.abs() > t)).all() and (rest == 0).any(), site


@pytest.mark.parametrize("base,m", [(0, 5), (6, 1), (6, 4), (3, 16)])
def test_reference_verify_rows_equal_decode_steps_with_sparsity(hf, base, m):
    model = trapetum.load(hf)
    model = trapetum.load(hf, sparsity=table_for(model, 0.08))
    dec = model.decoder
    g = torch.Generator().manual_seed(base * 31 + m)
    prompt = torch.randint(3, 300, (1, max(base, 1)), generator=g)[:, :base]
    rows = torch.randint(3, 300, (1, m), generator=g)
    c1, c2 = dec.new_cache(1, 64), dec.new_cache(1, 64)
    if base:
        dec(prompt, c1, 0)
        dec(prompt, c2, 0)
    steps = [dec(rows[:, r:r + 1], c1, base + r)[0, 0] for r in range(m)]
    ver = dec(rows, c2, base, mode=Mode.VERIFY)[0]
    assert all(torch.equal(ver[r], steps[r]) for r in range(m))


# -- the engine (torch fallbacks on the CPU) ----------------------------------------------------------------
def test_engine_sparse_matches_reference_and_keeps_the_verify_contract(hf):
    m = trapetum.load(hf)
    table = table_for(m, 0.05)
    ref = trapetum.load(hf, sparsity=table).logits(ids(20))
    dense = m.logits(ids(20))
    eng = GpuEngine(m.checkpoint, 48, device="cpu", sparsity=table)
    got = eng.prefill(ids(20), all_logits=True)
    rel = float((got - ref).norm() / ref.norm())
    rel_dense = float((got - dense).norm() / dense.norm())
    assert rel < 0.02 and rel < rel_dense / 3, (rel, rel_dense)
    res = check(eng, rows=(1, 3, 8, 16), bases=(6, 21))
    assert all(r["ok"] for r in res), [r for r in res if not r["ok"]]
    # rows from position 0 (the dense row inside a verify pass) equal decode steps from 0
    toks = torch.tensor(ids(5, 3))
    steps = []
    for r in range(5):
        eng.set_position(toks[r], r)
        eng.step(greedy=False)
        steps.append(eng.logits.clone())
    ver = eng.verify(toks, 0)
    assert all(torch.equal(ver[r], steps[r]) for r in range(5))
    # the engine without the option: the dense engine's bits
    e0, e1 = GpuEngine(m.checkpoint, 48, device="cpu"), GpuEngine(m.checkpoint, 48, device="cpu", sparsity=None)
    assert torch.equal(e0.prefill(ids(20), all_logits=True), e1.prefill(ids(20), all_logits=True))


# -- calibration, the .cbk section, the side file -----------------------------------------------------------
def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "trapetum.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_sparsify_side_file_for_an_hf_model(hf, calib, tmp_path):
    out = tmp_path / "t.json"
    table, path = trapetum.sparsify(str(hf), calib, 0.5, "o=0.7", out, n_seqs=4, seq_len=64, progress=False)
    assert path == out and table.targets["o"] == 0.7 and table.targets["qkv"] == 0.5
    ach = table.calibration["achieved"]
    assert abs(ach["qkv"] - 0.5) < 0.01 and abs(ach["o"] - 0.7) < 0.01, ach
    back = read_side_file(out, len(table.layers))
    assert back == SparsityTable(table.layers, table.targets, back.calibration)
    a = trapetum.load(hf, sparsity=str(out)).logits(ids(16))
    assert torch.equal(a, trapetum.load(hf, sparsity=back).logits(ids(16)))
    assert not torch.equal(a, trapetum.load(hf).logits(ids(16)))
    r = run_cli("sparsify", hf, "--calib", calib, "--sparsity", "0.3", "-o", tmp_path / "x.cbk", "--quiet")
    assert r.returncode == 1 and "only a .cbk model" in r.stderr and "Traceback" not in r.stderr


def test_sparsify_cbk_section_cli(hf, calib, tmp_path):
    from trapetum.quant.quantize import Recipe, quantize_to_cbk
    src = tmp_path / "m.cbk"
    quantize_to_cbk(str(hf), src, Recipe(bits=4, head_bits=8, weighted=False, iters=2).validate(), progress=False,
                    log=lambda s: None)
    r = run_cli("ppl", src, "--text", calib, "--ctx", "64", "--windows", "2", "--sparsity", "on", "--quiet")
    assert r.returncode == 1 and "no sparsity section" in r.stderr and "Traceback" not in r.stderr
    out = tmp_path / "s.cbk"
    r = run_cli("sparsify", src, "--calib", calib, "--sparsity", "0.4", "--site", "down=0.6", "-o", out,
                "--calib-seqs", "3", "--calib-len", "64", "--quiet")
    assert r.returncode == 0, r.stderr
    f = open_cbk(out)
    assert f.verify() == [] and f.sparsity is not None and f.sparsity.targets["down"] == 0.6
    assert len(f.sparsity.layers) == f.config.num_layers
    assert open_cbk(src).sparsity is None  # the source is untouched
    dense = trapetum.load(out).logits(ids(16))
    assert torch.equal(dense, trapetum.load(src).logits(ids(16)))  # same tensors, no option: dense bits
    assert not torch.equal(trapetum.load(out, sparsity="on").logits(ids(16)), dense)
    r = run_cli("ppl", out, "--text", calib, "--ctx", "64", "--windows", "2", "--sparsity", "on", "--quiet")
    assert r.returncode == 0 and r.stdout.startswith("PPL "), r.stderr
    # in place (no -o), then removed again
    r = run_cli("sparsify", src, "--calib", calib, "--sparsity", "0.25", "--calib-seqs", "2", "--calib-len", "32",
                "--quiet")
    assert r.returncode == 0 and open_cbk(src).sparsity.targets["qkv"] == 0.25, r.stderr
    rewrite_with_sparsity(src, src, None)
    assert open_cbk(src).sparsity is None and open_cbk(src).verify() == []


# -- hostile sections and side files ------------------------------------------------------------------------
def good_section(n=2):
    return {"version": 1, "method": "teal-magnitude", "targets": {"qkv": 0.25},
            "layers": [{s: 0.1 for s in SITES} for _ in range(n)], "calibration": {}}


BAD = [
    (lambda d: d.update(layers=[]), "sparsity.layers"),
    (lambda d: d["layers"].pop(), "sparsity.layers has 1 entries"),
    (lambda d: d["layers"][1].update(o=-1.0), "sparsity.layers[1].o"),
    (lambda d: d["layers"][0].update(down="0.1"), "sparsity.layers[0].down"),
    (lambda d: d["layers"][0].update(qkv=True), "sparsity.layers[0].qkv"),
    (lambda d: d["layers"][0].pop("gate_up"), "sparsity.layers[0].gate_up"),
    (lambda d: d["layers"].__setitem__(0, [1]), "sparsity.layers[0]"),
    (lambda d: d.update(version="1"), "sparsity.version"),
    (lambda d: d.update(targets={"qkv": 1.0}), "sparsity.targets.qkv"),
    (lambda d: d.update(targets={"x": 0.1}), "sparsity.targets.x"),
    (lambda d: d.update(method="other"), "sparsity.method"),
    (lambda d: d.update(calibration=3), "sparsity.calibration"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_hostile_cbk_section_fails_naming_the_field(tmp_path, case):
    cfg, dense, quantized = tiny_model()
    sec = good_section(cfg.num_layers)
    mutate, field = BAD[case]
    mutate(sec)
    from trapetum.formats.cbk_write import CbkWriter
    from trapetum.formats.cbk_spec import QuantSpec, TensorSpec
    p = tmp_path / "h.cbk"
    with CbkWriter(p, config=cfg, tokenizer=tiny_tokenizer(), sparsity=sec) as w:
        for n, t in dense.items():
            w.declare_dense(n, TensorSpec.of(t))
        for n, r in quantized.items():
            w.declare_quantized(n, QuantSpec.of(r))
        for n, t in dense.items():
            w.put_dense(n, t)
        for n, r in quantized.items():
            w.put_quantized(n, r)
    with pytest.raises(FormatError, match=field.replace("[", r"\[").replace("]", r"\]")):
        open_cbk(p)
    side = tmp_path / "h.json"
    side.write_text(json.dumps({"format": "trapetum-sparsity", **sec}))
    with pytest.raises(FormatError, match=str(side)):
        read_side_file(side, cfg.num_layers)


def test_other_section_version_opens_but_is_not_applied(tmp_path):
    cfg, dense, quantized = tiny_model()
    p = write_cbk(tmp_path / "a.cbk", config=cfg, dense=dense, quantized=quantized, tokenizer=tiny_tokenizer())
    sec = dict(good_section(cfg.num_layers), version=2, layers="a future layout")
    rewrite_with_sparsity(p, p, sec)
    f = open_cbk(p)
    assert f.sparsity is None and f.verify() == []
    with pytest.raises(FormatError, match="version 2"):
        trapetum.load(p, sparsity="on")


def test_bad_side_files(tmp_path, hf):
    n = trapetum.load(hf).config.num_layers
    cases = {"notjson": "{", "nan": json.dumps({"format": "trapetum-sparsity"})[:-1] + ', "x": NaN}',
             "format": json.dumps(good_section(n)), "list": "[1, 2]"}
    for name, text in cases.items():
        p = tmp_path / f"{name}.json"
        p.write_text(text)
        with pytest.raises(FormatError, match=str(p)):
            trapetum.load(hf, sparsity=str(p))
    with pytest.raises(FormatError, match="cannot read"):
        trapetum.load(hf, sparsity=str(tmp_path / "missing.json"))
    wrong = write_side_file(uniform(n + 1, 0.1), tmp_path / "w.json")
    with pytest.raises(FormatError, match=f"{n + 1} entries"):
        trapetum.load(hf, sparsity=str(wrong))
    with pytest.raises(TrapetumError, match="sparsity must be"):
        trapetum.load(hf, sparsity=3)
    assert SiteThresholds(0.0, 1.0, 2.0, math.pi).down == math.pi
