"""Hostile .cbk metadata: every config, tokenizer, recipe, provenance, generation and sparsity field set to random
JSON values (the metadata hash recomputed, as an attacker would), then open, verify, load and generate.

The outcome must be a FormatError (one line, naming the file) at open, or a file that verifies, loads and
generates (a TrapetumError from load or generation is allowed only when it names the problem in one line).
Anything else (TypeError, AttributeError, RuntimeError, ...) fails with the case to replay, as does a case
over 10 s; the fuzzing process stays under 2 GB. CI runs ``SECONDS`` of cases; by hand (the case count is printed):

    python3 tests/test_hostile_cbk.py --cases 5000 [--seed 7]
"""
from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import pytest

import fuzz_harness
from cbk_helpers import join_file, split_file, tiny_config, tiny_model, tiny_tokenizer
from trapetum.errors import FormatError, TrapetumError
from trapetum.formats.cbk import open_cbk, write_cbk
from trapetum.formats.cbk_spec import header_digest
from trapetum.models.config import ModelConfig

SECONDS = 8.0
CASE_LIMIT_S = 10.0
RSS_LIMIT = 2 << 30
SPARSITY = {"version": 1, "layers": [{"qkv": 0.1, "o": 0.2, "gate_up": 0.1, "down": 0.3}] * 2}

CONFIG_FIELDS = [f for f in ModelConfig.__dataclass_fields__]
TOKENIZER_FIELDS = ["tokenizer_json", "bos_token", "eos_tokens", "chat_template", "extra_special"]
OTHER = {"recipe": ["layer_errors", "bits_per_weight", "hf_config", "bits"],
         "provenance": ["source", "created", "tool_version"],
         "generation": ["eos_token_id", "temperature", "do_sample"],
         "sparsity": ["version", "layers", "targets", "method", "calibration"]}


def random_value(rng: random.Random, depth: int = 0):
    """A JSON value, biased to the edges: zero, negatives, huge and tiny numbers, wrong types, nesting."""
    pick = rng.randrange(12 if depth < 3 else 8)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice([0, 1, -1, 2, 3, 7, 8, 16, 64, 2**31, 2**40, 2**63, 10**30, -2**63])
    if pick == 3:
        return rng.randint(-5, 300)
    if pick == 4:
        return rng.choice([0.0, -0.0, 0.5, 1.0, 1e-300, 5e-324, 1e-45, 1e300, -1.0, 3.5, 1e6, 10000.0])
    if pick == 5:
        return rng.choice(["", "x", "full", "sliding", "silu", "gelu_tanh", "linear", "llama3", "<s>", "</s>",
                           "{{ 1/0 }}", "{% for %}", "{{ messages[0].content }}", "9" * 40, "\u0000"])
    if pick == 6:
        return rng.uniform(-10, 10)
    if pick == 7:
        return "".join(rng.choice("ab{}%<>|") for _ in range(rng.randint(0, 12)))
    if pick in (8, 9):
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = ["rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
            "type", "content", "a", "quantization_config"]
    return {rng.choice(keys): random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def plausible(rng: random.Random, field: str):
    """A value of the right kind for the field, so that cases get past the type checks into the ranges."""
    base = tiny_config()
    v = getattr(base, field, None)
    if isinstance(v, bool):
        return rng.choice([True, False])
    if isinstance(v, int):
        return rng.choice([0, 1, 2, 3, 4, 5, 6, 8, 9, 16, 17, 64, 1000, 2**20, 2**30])
    if isinstance(v, float):
        return rng.choice([0.0, 1e-12, 0.25, 0.5, 1.0, 2.0, 1e4, 1e12, 1e20])
    if field == "rope_scaling":
        return {"rope_type": rng.choice(["linear", "llama3", "yarn"]), "factor": rng.choice([0, 1, 8.0, -2]),
                "low_freq_factor": rng.choice([1.0, 4.0, 0]), "high_freq_factor": rng.choice([4.0, 1.0]),
                "original_max_position_embeddings": rng.choice([64, 0, 2**40])}
    if field == "layer_types":
        return [rng.choice(["full", "sliding", "x"]) for _ in range(rng.choice([1, 2, 3]))]
    return random_value(rng)


def mutate(rng: random.Random, meta: dict) -> tuple[dict, str]:
    meta = json.loads(json.dumps(meta))
    section = rng.choice(["config"] * 6 + ["tokenizer"] * 3 + list(OTHER))
    changes = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        if section == "config":
            field = rng.choice(CONFIG_FIELDS)
            v = plausible(rng, field) if rng.random() < 0.5 else random_value(rng)
            meta["config"][field] = v
        elif section == "tokenizer":
            field = rng.choice(TOKENIZER_FIELDS)
            v = random_value(rng)
            meta["tokenizer"][field] = v
        else:
            field = rng.choice(OTHER[section])
            v = random_value(rng)
            if not isinstance(meta.get(section), dict) or rng.random() < 0.1:
                meta[section] = {} if rng.random() < 0.8 else random_value(rng)
            if isinstance(meta[section], dict):
                meta[section][field] = v
        changes.append(f"{section}.{field}={json.dumps(v)[:60]}")
    return meta, "; ".join(changes)


def rebuild(raw: bytes, meta: dict) -> bytes:
    header, body = split_file(raw)
    text = json.dumps(meta)
    rows = {n: (e["dtype"], e["shape"], *e["data_offsets"]) for n, e in header.items() if n != "__metadata__"}
    header["__metadata__"] = {"trapetum": text, "trapetum_sha256": header_digest(text, rows)}
    return join_file(header, body)


def exercise(path) -> str:
    """open -> verify -> load -> generate; returns the outcome, raises on anything but the project's errors."""
    from trapetum.api import Model

    def clean(e: TrapetumError) -> None:
        msg = str(e)
        assert "\n" not in msg and msg, msg
    try:
        cbk = open_cbk(path)
    except FormatError as e:
        assert str(e).startswith(str(path)), str(e)
        clean(e)
        return "refused at open"
    problems = cbk.verify()
    try:
        # a sparsity section that passed the checks is applied (activation sparsity, models/sparsity.py)
        m = Model(cbk.to_checkpoint(), device="cpu", sparsity="on" if cbk.sparsity is not None else None)
        m.generate([1, 2, 3], max_new_tokens=3, temperature=0.7, seed=0)
        if m.tokenizer is not None and m.tokenizer.chat_template:
            m.chat([{"role": "user", "content": "hello"}], max_new_tokens=2)
    except TrapetumError as e:
        clean(e)
        return "refused at load/generation" + (" (verify too)" if problems else "")
    return "generates" + (" (verify reports problems)" if problems else "")


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("hostile") / "valid.cbk"
    cfg, dense, quantized = tiny_model(tiny_config(num_layers=2, vocab_size=16))
    write_cbk(path, config=cfg, dense=dense, quantized=quantized, tokenizer=tiny_tokenizer(),
              recipe={"bits": 4, "layer_errors": {"x": 0.1}}, provenance={"source": "x"},
              generation={"eos_token_id": 2},
              sparsity=SPARSITY)
    return path.read_bytes()


def run(valid: bytes, path, seconds: float, cases: int | None = None, seed: int = 21) -> dict[str, int]:
    header, _ = split_file(valid)
    meta = json.loads(header["__metadata__"]["trapetum"])
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    t0, done, worst = time.perf_counter(), 0, 0.0
    while (cases is None and time.perf_counter() - t0 < seconds) or (cases is not None and done < cases):
        case_seed = rng.randrange(2**32)
        new, what = mutate(random.Random(case_seed), meta)
        path.write_bytes(rebuild(valid, new))
        t1 = time.perf_counter()
        try:
            outcome = exercise(path)
        except Exception as e:  # noqa: BLE001 -- the finding
            raise AssertionError(f"case seed {case_seed} ({what}): {type(e).__name__}: {e}") from e
        dt = time.perf_counter() - t1
        worst = max(worst, dt)
        assert dt < CASE_LIMIT_S, f"case seed {case_seed} ({what}) took {dt:.1f} s"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        done += 1
    outcomes["_cases"], outcomes["_worst_ms"] = done, int(worst * 1000)
    return outcomes


def test_metadata_fuzz():
    out, rss = fuzz_child("--seconds", str(SECONDS))
    print(out, f"peak RSS {rss / 2**20:.0f} MiB")
    assert rss < RSS_LIMIT, f"peak RSS {rss / 2**30:.2f} GiB"
    assert out["_cases"] >= 50
    assert out.get("refused at open", 0) > 0 and out.get("generates", 0) > 0


@pytest.mark.parametrize("section,field,value,match", [
    ("config", "rope_scaling", True, "rope_scaling"),
    ("config", "rope_theta", None, "rope_theta"),
    ("config", "rms_norm_eps", 0, "rms_norm_eps"),
    ("config", "layer_types", "full", "layer_types"),
    ("config", "num_layers", 2**40, "layers"),
    ("config", "partial_rotary_factor", 1e-300, "rotary"),
    ("config", "rope_scaling", {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 4},
     "high_freq_factor"),
    ("config", "qk_norm", "yes", "qk_norm"),
    ("config", "attn_softcap", -1, "attn_softcap"),
    ("config", "rope_theta", 5e-324, "rope_theta"),          # found by the fuzzer: 0 in float32, NaN logits
    ("config", "final_softcap", 5e-324, "final_softcap"),
    ("tokenizer", "chat_template", 9, "chat_template"),
    ("tokenizer", "eos_tokens", [1], "eos_tokens"),
    ("tokenizer", "extra_special", {"messages": "x"}, "extra_special"),
    ("recipe", "layer_errors", {"a": "x"}, "layer_errors"),
    ("recipe", "hf_config", {"quantization_config": []}, "quantization_config"),
    ("provenance", "source", 5, "provenance.source"),
    ("sparsity", "layers", [{"qkv": 0.1}] * 2, r"sparsity.layers\[0\].o"),
    ("sparsity", "version", "1", "sparsity.version"),
    ("sparsity", "targets", {"down": 2}, "sparsity.targets.down"),
])
def test_known_crashers_refused_at_open(valid, tmp_path, capsys, section, field, value, match):
    """The reproductions of issue 21 (4): refused by ``verify`` and ``load`` alike, the field named."""
    header, _ = split_file(valid)
    meta = json.loads(header["__metadata__"]["trapetum"])
    meta[section][field] = value
    path = tmp_path / "bad.cbk"
    path.write_bytes(rebuild(valid, meta))
    with pytest.raises(FormatError, match=match) as e:
        open_cbk(path)
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)
    from trapetum import cli
    assert cli.main(["verify", str(path)]) == 1  # one line on stderr (issue 22: errors with the prefix)
    out, err = capsys.readouterr()
    assert not out and err.startswith("trapetum: error: ") and len(err.splitlines()) == 1, err


def _run_main(tmp: Path, seconds: float, cases: int | None, seed: int) -> dict:
    p = tmp / "valid.cbk"
    cfg, dense, quantized = tiny_model(tiny_config(num_layers=2, vocab_size=16))
    write_cbk(p, config=cfg, dense=dense, quantized=quantized, tokenizer=tiny_tokenizer(),
              recipe={"bits": 4, "layer_errors": {"x": 0.1}}, provenance={"source": "x"},
              generation={"eos_token_id": 2}, sparsity=SPARSITY)
    return run(p.read_bytes(), tmp / "case.cbk", seconds, cases, seed)


def fuzz_child(*args: str, timeout: float = 300.0) -> tuple[dict, int]:
    """This file's fuzzer in a fresh process (tests/fuzz_harness.py)."""
    return fuzz_harness.fuzz_child(__file__, *args, timeout=timeout)


if __name__ == "__main__":
    fuzz_harness.fuzz_main(sys.argv[1:], _run_main)
