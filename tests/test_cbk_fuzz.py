"""Fuzz the .cbk reader: seeded random mutations of a small valid file, bounded in count and time.

Every outcome must be a file that opens (then every tensor reads and verify() returns a list) or a
FormatError with a one-line message naming the file; anything else fails with the case to replay.
"""
from __future__ import annotations

import random
import struct
import time

import pytest

from cbk_helpers import join_file, split_file, tiny_config, tiny_model, tiny_tokenizer
from trapetum.errors import FormatError
from trapetum.formats.cbk import open_cbk, write_cbk
from trapetum.formats.cbk_contents import verify_file
from trapetum.formats.cbk_spec import header_digest

CASES = 400
SECONDS = 15.0


def _rehash(header: dict, text: str) -> dict:
    rows = {n: (e["dtype"], e["shape"], *e["data_offsets"]) for n, e in header.items() if n != "__metadata__"}
    header["__metadata__"] = {"trapetum": text, "trapetum_sha256": header_digest(text, rows)}
    return header


def _mutate_text(rng: random.Random, text: str) -> str:
    i = rng.randrange(len(text))
    op = rng.randrange(5)
    if op == 0 and text[i].isdigit():
        return text[:i] + rng.choice("0123456789") + text[i + 1:]
    if op == 1:
        return text[:i] + text[i + rng.randint(1, 8):]
    if op == 2:
        return text[:i] + rng.choice(['"', "{", "}", "[", "]", ",", ":", "-1", "null", "1e400", "9" * 30]) + text[i:]
    if op == 3:  # re-typed value: swap a JSON scalar for another
        for a, b in [("true", "false"), ("null", "{}"), ('"F16"', '"U8"'), ("[", "[0,"), ("4", "40")]:
            j = text.find(a, i)
            if j >= 0:
                return text[:j] + b + text[j + len(a):]
    return text[:i] + chr(rng.randrange(32, 0x3000)) + text[i + 1:]


def mutate(rng: random.Random, raw: bytes) -> bytes:
    (n,) = struct.unpack("<Q", raw[:8])
    op = rng.randrange(9)
    data = bytearray(raw)
    if op == 0:  # flip bits anywhere
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif op == 1:  # flip bits in the header
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(8, 8 + n)] ^= 1 << rng.randrange(8)
    elif op == 2:  # truncate
        del data[rng.randrange(len(data)):]
    elif op == 3:  # insert random bytes
        i = rng.randrange(len(data))
        data[i:i] = rng.randbytes(rng.randint(1, 16))
    elif op == 4:  # delete a range
        i = rng.randrange(len(data))
        del data[i:i + rng.randint(1, 64)]
    elif op == 5:  # header size field
        v = rng.choice([0, 1, n - 1, n + 1, n + 8, len(raw), 2**32, 2**63, 2**64 - 1, rng.randrange(2**64)])
        data[:8] = struct.pack("<Q", v)
    elif op == 6:  # change a digit of the tensor table (shapes / offsets), no re-hash
        digits = [i for i in range(8, 8 + n) if chr(data[i]).isdigit()]
        data[rng.choice(digits)] = ord(rng.choice("0123456789"))
    else:  # mutate the Trapetum metadata and re-hash, so that the semantic checks are what is fuzzed
        header, body = split_file(raw)
        text = header["__metadata__"]["trapetum"]
        for _ in range(rng.randint(1, 3)):
            text = _mutate_text(rng, text)
        return join_file(_rehash(header, text), body)
    return bytes(data)


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("fuzz") / "valid.cbk"
    cfg, dense, quantized = tiny_model(tiny_config(num_layers=1, layer_types=["full"], vocab_size=16))
    write_cbk(path, config=cfg, dense=dense, quantized=quantized, tokenizer=tiny_tokenizer(), recipe={"bits": 4})
    return path.read_bytes()


def exercise(path) -> str:
    """Open; if that works, read every tensor and verify. Returns the outcome."""
    try:
        cbk = open_cbk(path)
    except FormatError as e:
        msg = str(e)
        assert msg.startswith(str(path)) and "\n" not in msg, msg
        return "refused"
    ck = cbk.to_checkpoint()
    for name in ck.tensors:
        ck.tensors[name]
    cbk.size_breakdown()
    problems = cbk.verify()
    assert verify_file(path)[1] == problems  # `trapetum verify`'s torch-free path gives the torch reader's lines
    return "opened, verify fails" if problems else "opened, intact"


def test_fuzz_mutations(tmp_path, valid):
    rng = random.Random(20261130)
    outcomes: dict[str, int] = {}
    path = tmp_path / "fuzz.cbk"
    t0 = time.perf_counter()
    done = 0
    for case in range(CASES):
        if time.perf_counter() - t0 > SECONDS:
            break
        seed = rng.randrange(2**32)
        data = mutate(random.Random(seed), valid)
        path.write_bytes(data)
        try:
            outcome = exercise(path)
        except Exception as e:  # anything but FormatError is a reader bug
            pytest.fail(f"case {case} (mutation seed {seed}): {type(e).__name__}: {e}")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        done += 1
    print(f"{done} cases in {time.perf_counter() - t0:.1f} s: {outcomes}")
    assert done >= 100
    assert outcomes.get("refused", 0) > done // 4
