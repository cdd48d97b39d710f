"""Malformed .cbk files: each raises FormatError with a one-line message naming the file and the problem.

Cases are mutations of one small valid file. Container-level cases (size field, JSON, tensor table)
fail before the metadata hash is checked; metadata-level cases re-hash the header (as a buggy or
hostile writer would) so that the semantic check itself is what refuses them.
"""
from __future__ import annotations

import json
import struct
import time
import tracemalloc

import pytest

from cbk_helpers import join_file, split_file, tiny_model, tiny_tokenizer
from trapetum.errors import FormatError
from trapetum.formats.cbk import open_cbk, verify_cbk, write_cbk
from trapetum.formats.cbk_spec import header_digest

EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
Q0 = "model.layers.0.self_attn.q_proj.weight"
Q1 = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("cbk") / "valid.cbk"
    cfg, dense, quantized = tiny_model()
    write_cbk(path, config=cfg, dense=dense, quantized=quantized, tokenizer=tiny_tokenizer(), recipe={"bits": 4})
    open_cbk(path)  # the base case is valid
    return path.read_bytes()


# -- mutation helpers ------------------------------------------------------------------------------
def header_size(n):
    return lambda raw: struct.pack("<Q", n) + raw[8:]


def raw_header(text: bytes):
    return lambda raw: join_file(text, split_file(raw)[1])


def table(fn):
    """Edit the safetensors header (tensor table / __metadata__) without re-hashing."""
    def mutate(raw):
        header, body = split_file(raw)
        out = fn(header, body)
        return join_file(header, out if isinstance(out, bytes) else body)
    return mutate


def meta(fn):
    """Edit the Trapetum metadata (and optionally the table / data), then re-hash the header."""
    def mutate(raw):
        header, body = split_file(raw)
        m = json.loads(header["__metadata__"]["trapetum"])
        out = fn(m, header, body)
        body = out if isinstance(out, bytes) else body
        text = json.dumps(m)
        rows = {n: (e["dtype"], e["shape"], *e["data_offsets"]) for n, e in header.items() if n != "__metadata__"}
        header["__metadata__"] = {"trapetum": text, "trapetum_sha256": header_digest(text, rows)}
        return join_file(header, body)
    return mutate


def drop(header, body, name):
    """Remove a stored tensor's entry and bytes, shifting the other offsets."""
    b, e = header.pop(name)["data_offsets"]
    for k, v in header.items():
        if k != "__metadata__" and v["data_offsets"][0] >= e:
            v["data_offsets"] = [v["data_offsets"][0] - (e - b), v["data_offsets"][1] - (e - b)]
    return body[:b] + body[e:]


def entry(name, **kw):
    def fn(h, body):
        h[name].update(kw)
    return fn


def last_entry(h):
    return max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])


def same_size_pair(h):
    """Two tensors adjacent in the data with the same byte length (for an overlap)."""
    names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
    for a, b in zip(names, names[1:]):
        oa, ob = h[a]["data_offsets"], h[b]["data_offsets"]
        if oa[1] - oa[0] == ob[1] - ob[0] > 0:
            return a, b
    raise AssertionError("no pair")


def overlap(h, body):
    a, b = same_size_pair(h)
    h[b]["data_offsets"] = list(h[a]["data_offsets"])


def gap(h, body):
    for k, v in h.items():
        if k != "__metadata__":
            v["data_offsets"] = [v["data_offsets"][0] + 8, v["data_offsets"][1] + 8]
    return b"\0" * 8 + body


def extra_tensor(h, body):
    h["model.layers.0.extra"] = {"dtype": "U8", "shape": [8], "data_offsets": [len(body), len(body) + 8]}
    return body + b"\1" * 8


def drop_everywhere(m, h, body, name):
    m["dense"].remove(name)
    del m["checksums"][name]
    return drop(h, body, name)


def rename_dense(m, h, body, old, new):
    m["dense"][m["dense"].index(old)] = new
    m["checksums"][new] = m["checksums"].pop(old)
    h[new] = h.pop(old)


def reshape_norm(m, h, body):
    h[NORM]["shape"] = [2, 16]


def retype(m, h, body):
    h[NORM]["dtype"] = "I16" if h[NORM]["dtype"] in ("F16", "BF16") else "I32"


def config(**kw):
    def fn(m, h, body):
        for k, v in kw.items():
            if v is DELETE:
                del m["config"][k]
            else:
                m["config"][k] = v
    return fn


def set_meta(key, value):
    def fn(m, h, body):
        if value is DELETE:
            del m[key]
        else:
            m[key] = value
    return fn


def layer(name, **kw):
    def fn(m, h, body):
        for k, v in kw.items():
            if v is DELETE:
                del m["layers"][name][k]
            else:
                m["layers"][name][k] = v
    return fn


def share_codebook(m, h, body):
    m["layers"][Q1]["tensors"]["codebook"] = m["layers"][Q0]["tensors"]["codebook"]


def rename_layer(m, h, body):
    m["layers"]["model.layers.0.self_attn.x_proj.weight"] = m["layers"].pop(Q0)


def checksums(fn):
    def mutate(m, h, body):
        fn(m["checksums"])
    return mutate


DELETE = object()
DEEP = b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
DUP = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'

CASES = {
    # size field and truncation
    "empty": (lambda raw: b"", "too short"),
    "truncated_in_size_field": (lambda raw: raw[:5], "too short"),
    "header_size_zero": (header_size(0), "header size is 0"),
    "header_size_past_eof": (lambda raw: struct.pack("<Q", len(raw)) + raw[8:], "larger than the rest of the file"),
    "header_size_absurd": (header_size(2**63 + 5), "larger than the rest of the file"),
    "header_size_max_u64": (header_size(2**64 - 1), "larger than the rest of the file"),
    "truncated_in_header": (lambda raw: raw[:200], "larger than the rest of the file"),
    "truncated_at_data_start": (lambda raw: raw[:8 + struct.unpack("<Q", raw[:8])[0]], "past the end of the data"),
    "truncated_in_data": (lambda raw: raw[:-10], "past the end of the data"),
    "truncated_one_byte": (lambda raw: raw[:-1], "past the end of the data"),
    "trailing_bytes": (lambda raw: raw + b"\0" * 8, "8 bytes after the last tensor"),
    # header JSON
    "header_not_utf8": (raw_header(b'{"\xff\xfe":1}'), "not UTF-8"),
    "header_not_json": (raw_header(b"{not json at all"), "header is not valid JSON"),
    "header_is_list": (raw_header(b"[1, 2, 3]"), "header is not a JSON object"),
    "header_duplicate_tensor": (raw_header(DUP), "duplicate key 'a'"),
    "header_nested_deeply": (raw_header(DEEP), "nested too deeply"),
    "header_nan": (raw_header(b'{"a":{"dtype":"U8","shape":[NaN],"data_offsets":[0,1]}}'), "NaN, which is not JSON"),
    "header_huge_integer": (raw_header(b'{"a":{"dtype":"U8","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,1]}}'),
                            "header is not valid JSON"),
    # tensor table
    "entry_not_object": (table(lambda h, b: h.update({EMBED: 5})), "entry must be an object"),
    "entry_extra_key": (table(entry(EMBED, extra=1)), "entry must be an object with exactly"),
    "empty_tensor_name": (table(lambda h, b: h.update({"": h.pop(EMBED)})), "empty name"),
    "unknown_dtype": (table(entry(EMBED, dtype="F13")), "unknown dtype 'F13'"),
    "dtype_not_string": (table(entry(EMBED, dtype=16)), "unknown dtype 16"),
    "negative_dim": (table(entry(EMBED, shape=[-64, -32])), "negative dimension -64"),
    "float_dim": (table(entry(EMBED, shape=[64.0, 32])), "shape must be a list of at most 8 integers"),
    "bool_dim": (table(entry(EMBED, shape=[True, 32])), "shape must be a list"),
    "too_many_dims": (table(entry(EMBED, shape=[1] * 9)), "at most 8 integers"),
    "shape_product_overflow": (table(entry(EMBED, shape=[2**40, 2**40, 2**40])), "too many elements"),
    "shape_bytes_mismatch": (table(entry(EMBED, shape=[64, 31])), r"needs 3968 bytes but data_offsets span 4096"),
    "huge_declared_size": (table(entry(EMBED, shape=[2**31, 2**31], data_offsets=[0, 2**63])), "past the end"),
    "offsets_out_of_range": (table(lambda h, b: entry(last_entry(h), data_offsets=[
        h[last_entry(h)]["data_offsets"][0] + 8, h[last_entry(h)]["data_offsets"][1] + 8])(h, b)), "past the end"),
    "offsets_reversed": (table(entry(EMBED, data_offsets=[4096, 0])), "not an increasing pair"),
    "offsets_negative": (table(entry(EMBED, data_offsets=[-4096, 0])), "not an increasing pair"),
    "offsets_not_pair": (table(entry(EMBED, data_offsets=[0])), "data_offsets must be two integers"),
    "offsets_huge": (table(entry(EMBED, data_offsets=[2**64, 2**64 + 4096])), "past the end"),
    "offsets_overlap": (table(overlap), "overlaps the previous tensor"),
    "offsets_gap": (table(gap), "gap of 8 bytes"),
    # safetensors metadata and Trapetum identity
    "no_metadata": (table(lambda h, b: h.pop("__metadata__")), "no __metadata__"),
    "metadata_not_strings": (table(lambda h, b: h.update({"__metadata__": {"trapetum": 5}})), "object of strings"),
    "metadata_is_list": (table(lambda h, b: h.update({"__metadata__": ["x"]})), "object of strings"),
    "plain_safetensors": (table(lambda h, b: h["__metadata__"].pop("trapetum")), "no 'trapetum' entry"),
    "trapetum_not_json": (table(lambda h, b: h["__metadata__"].update(trapetum="{oops")),
                          "trapetum metadata is not valid JSON"),
    "trapetum_not_object": (table(lambda h, b: h["__metadata__"].update(trapetum="[1]")), "not a JSON object"),
    "wrong_format_name": (meta(set_meta("format", "gguf")), "format is 'gguf', expected 'trapetum-cbk'"),
    "version_not_int": (meta(set_meta("version", "1")), "version is '1', expected an integer"),
    "version_missing": (meta(set_meta("version", DELETE)), "version is None"),
    "header_edited_without_hash": (table(lambda h, b: h["__metadata__"].update(
        trapetum=h["__metadata__"]["trapetum"].replace('"rope_theta":10000.0', '"rope_theta":500000.0'))),
        "metadata checksum mismatch"),
    "dtype_flipped_same_size": (table(entry(EMBED, dtype="BF16")), "metadata checksum mismatch"),
    "hash_missing": (table(lambda h, b: h["__metadata__"].pop("trapetum_sha256")), "metadata checksum mismatch"),
    # config
    "config_missing": (meta(set_meta("config", DELETE)), "no 'config'"),
    "config_not_object": (meta(set_meta("config", [])), "config is not an object"),
    "config_missing_field": (meta(config(hidden_size=DELETE)), "invalid config: .*hidden_size"),
    "config_unknown_field": (meta(config(moe_experts=8)), "unknown config fields"),
    "config_inconsistent_heads": (meta(config(num_kv_heads=3)), "not a multiple of num_kv_heads"),
    "config_wrong_type": (meta(config(rms_norm_eps="tiny")), "invalid config"),
    "config_layer_types": (meta(config(layer_types=["full", "sliding"])), "sliding layers need"),
    "config_absurd_layers": (meta(config(num_layers=10**9, layer_types=[])), "10+ layers but the file stores only"),
    "config_more_layers": (meta(config(num_layers=3, layer_types=["full"] * 3, mlp_types=["dense"] * 3)),
                           "'model.layers.2.input_layernorm.weight' required by the config is missing"),
    "config_other_hidden": (meta(config(hidden_size=48)), "has shape .*config expects"),
    # layers, dense, references
    "layers_not_object": (meta(set_meta("layers", [])), "layers is not an object"),
    "layer_missing_scheme": (meta(layer(Q0, scheme=DELETE)), "entry must be an object with scheme"),
    "layer_empty_scheme": (meta(layer(Q0, scheme="")), "scheme must be a non-empty string"),
    "layer_shape_three_dims": (meta(layer(Q0, shape=[32, 32, 1])), "shape must be two integers"),
    "layer_shape_vs_config": (meta(layer(Q0, shape=[32, 33])), r"has shape \[32, 33\], config expects \[32, 32\]"),
    "layer_params_not_object": (meta(layer(Q0, params=4)), "params must be an object"),
    "layer_not_a_projection": (meta(rename_layer), "not a projection of this model config"),
    "layer_tensor_not_in_file": (meta(layer(Q0, tensors={"codes": "nope", "codebook": "nope2"})),
                                 "names tensor 'nope', which is not in the file"),
    "layer_no_tensors": (meta(layer(Q0, tensors={})), "unreferenced|has no tensors|not referenced"),
    "layer_bias_not_string": (meta(layer(Q0, bias=3)), "bias must be a stored tensor name or null"),
    "tensor_used_twice": (meta(share_codebook), "is used both as codebook of"),
    "dense_not_list": (meta(set_meta("dense", {"a": 1})), "dense is not a list"),
    "dense_listed_twice": (meta(lambda m, h, b: m["dense"].append(NORM)), "listed twice"),
    "dense_tensor_missing_from_file": (meta(lambda m, h, b: (m["checksums"].pop(NORM), drop(h, b, NORM))[1]),
                                       "names tensor 'model.norm.weight', which is not in the file"),
    "required_tensor_missing": (meta(lambda m, h, b: drop_everywhere(m, h, b, NORM)),
                                "'model.norm.weight' required by the config is missing"),
    "dense_not_in_config": (meta(lambda m, h, b: rename_dense(m, h, b, NORM, "model.final_norm.weight")),
                            "not a tensor of this model config"),
    "dense_shape_vs_config": (meta(reshape_norm), r"has shape \[2, 16\], config expects \[32\]"),
    "dense_integer_dtype": (meta(retype), "has dtype I(16|32), expected one of"),
    "unreferenced_tensor": (meta(lambda m, h, b: (m["checksums"].update({"model.layers.0.extra": "0" * 64}),
                                                  extra_tensor(h, b))[1]), "not referenced by the metadata"),
    # checksums
    "checksums_missing": (meta(set_meta("checksums", DELETE)), "no 'checksums'"),
    "checksums_not_object": (meta(set_meta("checksums", ["x"])), "checksums is not an object"),
    "checksum_entry_missing": (meta(checksums(lambda c: c.pop(EMBED))), "no checksum for tensor"),
    "checksum_not_hex": (meta(checksums(lambda c: c.update({EMBED: "z" * 64}))), "not a sha256 hex digest"),
    "checksum_extra_entry": (meta(checksums(lambda c: c.update({"ghost": "0" * 64}))), "'ghost', which is not in"),
    "checksum_algorithm": (meta(set_meta("checksum", "md5")), "checksum algorithm is 'md5'"),
    # tokenizer and free-form sections
    "tokenizer_not_object": (meta(set_meta("tokenizer", 5)), "tokenizer must be an object or null"),
    "tokenizer_json_missing": (meta(set_meta("tokenizer", {"bos_token": "<s>"})), "no tokenizer_json"),
    "tokenizer_json_garbage": (meta(lambda m, h, b: m["tokenizer"].update(tokenizer_json='{"model": 3}')),
                               "tokenizer does not load"),
    "recipe_not_object": (meta(set_meta("recipe", "4bit")), "recipe must be an object or null"),
}


def test_at_least_30_distinct_cases():
    assert len(CASES) >= 30 and len({m for _, m in CASES.values()}) >= 30


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_file_is_refused(tmp_path, valid, case):
    mutate, expected = CASES[case]
    path = tmp_path / f"{case}.cbk"
    path.write_bytes(mutate(valid))
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(FormatError) as e:
            open_cbk(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    msg = str(e.value)
    assert msg.startswith(str(path)) and "\n" not in msg and len(msg) < 400, msg
    assert __import__("re").search(expected, msg), f"{case}: {msg}"
    assert peak < 64 * 2**20, f"{case}: {peak / 2**20:.0f} MiB allocated"
    assert time.perf_counter() - t0 < 10
    assert verify_cbk(path) == (None, [msg])
