"""Hostile GGUF files: a structure-aware fuzzer and the reproductions of issue 21 (3).

The fuzzer knows the GGUF layout: it walks a valid file, records where every count, string length, value
type, array length, tensor rank, dimension, tensor type and data offset lives, and sets those to edge values
(0, 1, n +- 1, 2**31, 2**63, 2**64 - 1, ...); it also rewrites the file with one metadata value replaced by
a random value of a random GGUF type (counts, sizes, RoPE, tokenizer arrays, special ids, the template), and
flips and cuts bytes. Every case must load (then every tensor reads, the tokenizer encodes, the model
generates on the CPU) or raise one of the project's errors, one line naming the file; no case over 10 s;
the fuzzing process stays under 2 GB. CI runs ``SECONDS``; by hand (the case count is printed):

    python3 tests/test_hostile_gguf.py --cases 20000 [--seed 7]
"""
from __future__ import annotations

import random
import resource
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import fuzz_harness  # noqa: E402
from test_gguf import TINY, hf_tensors, write_gguf  # noqa: E402
from trapetum.errors import ConfigError, FormatError, TrapetumError  # noqa: E402
from trapetum.formats.gguf import load_gguf  # noqa: E402

SECONDS = 8.0
CASE_LIMIT_S = 10.0
RSS_LIMIT = 2 << 30
ARR = gguf.GGUFValueType.ARRAY
Q = gguf.GGMLQuantizationType
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"


def sp_tokenizer() -> dict:
    """A SentencePiece-style ("llama") vocabulary: byte pieces, letters, a few merges' worth of pieces."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(16)] + \
        ["\u2581", "a", "b", "c", "\u2581a", "ab", "\u2581ab", "<|user|>", "<|assistant|>"]
    pieces += [f"p{i}" for i in range(TINY["V"] - len(pieces))]
    types = [2, 3, 3] + [6] * 16 + [1] * 7 + [3, 3] + [1] * (TINY["V"] - 28)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": (pieces, ARR),
            "tokenizer.ggml.scores": ([float(-i) for i in range(len(pieces))], ARR),
            "tokenizer.ggml.token_type": (types, ARR), "tokenizer.chat_template": TEMPLATE}


def base_file(path: Path, arch: str = "llama", meta_over: dict | None = None, tok: dict | None = None,
              tensors: dict | None = None) -> Path:
    t = tensors if tensors is not None else hf_tensors(arch)
    return write_gguf(path, arch, t, meta_over=meta_over, tokenizer=sp_tokenizer() if tok is None else tok,
                      qtypes={"blk.0.attn_q.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.F16})


# -- the layout walker -------------------------------------------------------------------------------
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def fields(raw: bytes) -> list[tuple[str, int, str]]:
    """(kind, byte offset, struct format) of every structural number in a valid GGUF header."""
    out = [("n_tensors", 8, "Q"), ("n_kv", 16, "Q")]
    pos = 24

    def string(kind: str) -> None:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", raw, pos)
        out.append((kind, pos, "Q"))
        pos += 8 + n

    def value(vtype: int) -> None:
        nonlocal pos
        if vtype in _SCALAR:
            out.append(("value", pos, _SCALAR[vtype]))
            pos += struct.calcsize(_SCALAR[vtype])
        elif vtype == 8:
            string("value_strlen")
        else:
            (itype,) = struct.unpack_from("<I", raw, pos)
            out.append(("array_type", pos, "I"))
            (n,) = struct.unpack_from("<Q", raw, pos + 4)
            out.append(("array_len", pos + 4, "Q"))
            pos += 12
            for i in range(n):
                if i < 3:
                    value(itype)
                elif itype in _SCALAR:
                    pos += struct.calcsize(_SCALAR[itype]) * (n - i)
                    break
                else:
                    (m,) = struct.unpack_from("<Q", raw, pos)
                    pos += 8 + m
    (n_tensors, n_kv) = struct.unpack_from("<QQ", raw, 8)
    for _ in range(n_kv):
        string("key_len")
        (vtype,) = struct.unpack_from("<I", raw, pos)
        out.append(("value_type", pos, "I"))
        pos += 4
        value(vtype)
    for _ in range(n_tensors):
        string("name_len")
        (nd,) = struct.unpack_from("<I", raw, pos)
        out.append(("n_dims", pos, "I"))
        pos += 4
        for _ in range(nd):
            out.append(("dim", pos, "Q"))
            pos += 8
        out.append(("tensor_type", pos, "I"))
        out.append(("tensor_offset", pos + 4, "Q"))
        pos += 12
    return out


def edge(rng: random.Random, old: int, fmt: str) -> int | float:
    if fmt in "fd":
        return rng.choice([0.0, -1.0, 1e-300, float("inf"), float("nan"), 1e30, old * 2])
    bits = struct.calcsize(fmt) * 8
    top = (1 << bits) - 1
    v = rng.choice([0, 1, 2, old - 1, old + 1, old * 2, old * 1000, 2**31, 2**32 - 1, 2**63, top,
                    rng.randrange(top + 1)])
    if fmt.islower():           # signed
        v = ((v + (1 << (bits - 1))) % (1 << bits)) - (1 << (bits - 1))
    return v % (top + 1) if not fmt.islower() else v


META_KEYS = ["block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
             "attention.key_length", "rope.dimension_count", "feed_forward_length", "context_length",
             "rope.freq_base", "attention.layer_norm_rms_epsilon", "vocab_size", "attention.sliding_window",
             "rope.scaling.type", "rope.scaling.factor"]
TOK_KEYS = ["tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.model",
            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.chat_template",
            "tokenizer.ggml.add_bos_token", "tokenizer.ggml.merges", "tokenizer.ggml.pre"]


def random_meta_value(rng: random.Random):
    """(value, GGUFValueType or None for the writer's choice) of a random type."""
    T = gguf.GGUFValueType
    pick = rng.randrange(9)
    if pick == 0:
        return rng.choice([0, 1, 3, 7, 64, 2**31 - 1, 2**32 - 1, 300_000_000]), T.UINT32
    if pick == 1:
        return rng.choice([0, 2**40, 2**63 - 1, -1]), T.INT64
    if pick == 2:
        return rng.choice([0.0, -1.0, 1e-40, 4e8, float("inf"), float("nan"), 1e38]), T.FLOAT32
    if pick == 3:
        return rng.choice(["", "x", "linear", "llama3", "gpt2", "llama", "{{ 1/0 }}", "a" * 5000]), T.STRING
    if pick == 4:
        return rng.choice([True, False]), T.BOOL
    if pick == 5:
        return [rng.randint(-3, 200) for _ in range(rng.choice([1, 5, 96]))], ARR
    if pick == 6:
        return [rng.choice(["a", "", "a b", "x" * 3000, "<s>"]) for _ in range(rng.choice([1, 96]))], ARR
    if pick == 7:
        return [rng.choice([0.0, 1.5, float("nan")]) for _ in range(rng.choice([1, 96]))], ARR
    return [True] * rng.choice([1, 96]), ARR


def write_with(path: Path, rng: random.Random) -> str:
    """A file written with one metadata value (or a tensor's shape, or a rope_freqs tensor) replaced."""
    arch = rng.choice(["llama", "llama", "qwen2", "gemma2", "phi3"])
    kind = rng.randrange(3)
    tensors = hf_tensors(arch)
    if kind == 0:
        key = f"{rng.choice(META_KEYS)}"
        v, t = random_meta_value(rng)
        tok = sp_tokenizer()
        _write_raw(path, arch, tensors, {key: (v, t)}, tok)
        return f"{arch} {key}={str(v)[:40]}"
    if kind == 1:
        key = rng.choice(TOK_KEYS)
        v, t = random_meta_value(rng)
        tok = sp_tokenizer()
        tok[key] = (v, t) if t is ARR else (v, t)
        _write_raw(path, arch, tensors, {}, tok)
        return f"{arch} {key}={str(v)[:40]}"
    n = rng.choice(sorted(tensors))
    shape = tensors[n].shape
    new_shape = tuple(max(1, d + rng.choice([-1, 1, d])) for d in shape) if rng.random() < 0.7 else (2,)
    tensors = dict(tensors)
    if rng.random() < 0.5:
        tensors[n] = np.zeros(new_shape, dtype=np.float32)
        what = f"{n} shape {new_shape}"
    else:
        tensors["rope_freqs.weight"] = np.full(rng.choice([1, 2, 8, 9]), rng.choice([1.0, 8.0, 0.0, -1.0]),
                                               dtype=np.float32)
        what = "rope_freqs"
    _write_raw(path, arch, tensors, {}, sp_tokenizer())
    return f"{arch} {what}"


def _write_raw(path: Path, arch: str, tensors: dict, meta: dict, tok: dict) -> None:
    extra = {k: v for k, v in tensors.items() if k == "rope_freqs.weight"}
    body = {k: v for k, v in tensors.items() if k not in extra}
    over = {k: None for k in meta}          # the base value left out; the hostile one is added below
    w_tok = dict(tok)
    for k, (v, t) in meta.items():
        w_tok[f"{arch}.{k}"] = (v, t)
    write_gguf(path, arch, body, meta_over=over, tokenizer=w_tok, extra_tensors=extra)


def exercise(path: Path) -> str:
    from trapetum.api import Model

    def clean(e: BaseException, named: bool = True) -> None:
        msg = str(e)
        assert msg and "\n" not in msg and (str(path) in msg or not named), msg
    try:
        ck = load_gguf(path)
        for n in ck.tensors:
            ck.tensors[n]
    except TrapetumError as e:
        clean(e)
        return "refused at load"
    try:
        if ck.tokenizer is not None:
            ck.tokenizer.encode("ab abc")
            if ck.tokenizer.chat_template:
                ck.tokenizer.encode_chat([{"role": "user", "content": "ab <|user|>"}])
        m = Model(ck, device="cpu")
        m.generate([1, 2], max_new_tokens=2, temperature=0.8, seed=0)
    except TrapetumError as e:       # a file fault names the file; a generation limit need not
        clean(e, named=not str(e).startswith("prompt of"))
        return "refused at generation"
    return "generates"


def run(tmp: Path, seconds: float, cases: int | None = None, seed: int = 21) -> dict:
    base = base_file(tmp / "base.gguf").read_bytes()
    where = fields(base)
    header_end = max(off for _, off, _ in where) + 8
    rng = random.Random(seed)
    path = tmp / "case.gguf"
    out: dict = {}
    t0, done, worst = time.perf_counter(), 0, 0.0
    while (cases is None and time.perf_counter() - t0 < seconds) or (cases is not None and done < cases):
        cs = rng.randrange(2**32)
        r = random.Random(cs)
        op = r.randrange(10)
        if op < 5:
            kind, off, fmt = r.choice(where)
            (old,) = struct.unpack_from("<" + fmt, base, off)
            v = edge(r, int(old) if not isinstance(old, float) else old, fmt)
            b = bytearray(base)
            try:
                struct.pack_into("<" + fmt, b, off, v)
            except struct.error:
                struct.pack_into("<" + fmt, b, off, 0)
            path.write_bytes(bytes(b))
            what = f"{kind}@{off}={v}"
        elif op < 8:
            try:
                what = write_with(path, r)
            except (ValueError, TypeError, OverflowError, struct.error):   # gguf's writer refused the value
                continue
        else:
            b = bytearray(base)
            for _ in range(r.randint(1, 6)):
                b[r.randrange(header_end)] = r.randrange(256)
            if r.random() < 0.3:
                b = b[:r.randrange(len(b))]
            path.write_bytes(bytes(b))
            what = "bytes"
        t1 = time.perf_counter()
        try:
            outcome = exercise(path)
        except Exception as e:  # noqa: BLE001 -- the finding
            raise AssertionError(f"case seed {cs} ({what}): {type(e).__name__}: {e}") from e
        dt = time.perf_counter() - t1
        worst = max(worst, dt)
        assert dt < CASE_LIMIT_S, f"case seed {cs} ({what}) took {dt:.1f} s"
        out[outcome] = out.get(outcome, 0) + 1
        done += 1
    out["_cases"], out["_worst_ms"] = done, int(worst * 1000)
    return out


def test_structure_aware_fuzz():
    out, rss = fuzz_child("--seconds", str(SECONDS))
    print(out, f"peak RSS {rss / 2**20:.0f} MiB")
    assert rss < RSS_LIMIT, f"peak RSS {rss / 2**30:.2f} GiB"
    assert out["_cases"] >= 40 and out.get("refused at load", 0) > 0 and out.get("generates", 0) > 0


# -- the reproductions ---------------------------------------------------------------------------------
def _refused(path: Path, err=TrapetumError, match: str = "") -> str:
    t0 = time.perf_counter()
    with pytest.raises(err, match=match) as e:
        load_gguf(path)
    assert time.perf_counter() - t0 < 5
    msg = str(e.value)
    assert msg.startswith(str(path)) and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("count", [300_000_000, 2**40])
def test_huge_block_count_refused_before_allocating(tmp_path, count):
    p = base_file(tmp_path / "m.gguf", meta_over={"block_count": None},
                  tok={**sp_tokenizer(), "llama.block_count": (count, gguf.GGUFValueType.UINT64)})
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _refused(p, ConfigError, "block_count")
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024 < 64 << 20


@pytest.mark.parametrize("rot", [400_000_000, 2**33])
def test_huge_rope_dimension_with_small_rope_freqs(tmp_path, rot):
    tensors = hf_tensors("llama")
    p = tmp_path / "m.gguf"
    write_gguf(p, "llama", tensors, meta_over={"rope.dimension_count": None},
               tokenizer={**sp_tokenizer(), "llama.rope.dimension_count": (rot, gguf.GGUFValueType.UINT64)},
               extra_tensors={"rope_freqs.weight": np.array([1.0, 8.0], dtype=np.float32)})
    _refused(p, ConfigError, "rope.dimension_count")
    write_gguf(p, "llama", tensors, tokenizer=sp_tokenizer(),
               extra_tensors={"rope_freqs.weight": np.array([1.0, 8.0], dtype=np.float32)})
    _refused(p, ConfigError, "rope_freqs has 2 entries")


def test_zero_dimension_and_zero_key_length(tmp_path):
    raw = bytearray(base_file(tmp_path / "m.gguf").read_bytes())
    kind, off, fmt = next(f for f in fields(bytes(raw)) if f[0] == "dim")
    struct.pack_into("<Q", raw, off, 0)
    (tmp_path / "z.gguf").write_bytes(bytes(raw))
    _refused(tmp_path / "z.gguf", FormatError, "zero dimension")
    p = write_gguf(tmp_path / "g.gguf", "gemma2", hf_tensors("gemma2"), meta_over={"attention.key_length": 0},
                   tokenizer=sp_tokenizer())
    _refused(p, ConfigError, "key_length")


def _run_main(tmp: Path, seconds: float, cases: int | None, seed: int) -> dict:
    return run(tmp, seconds, cases, seed)


def fuzz_child(*args: str, timeout: float = 300.0) -> tuple[dict, int]:
    """This file's fuzzer in a fresh process (tests/fuzz_harness.py)."""
    return fuzz_harness.fuzz_child(__file__, *args, timeout=timeout)


if __name__ == "__main__":
    fuzz_harness.fuzz_main(sys.argv[1:], _run_main)
