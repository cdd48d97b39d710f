"""Where the bytes of a .cbk file go: per tensor kind and role (codes, codebooks, scales, dense), plus the header.

    python3 scripts/cbk_sizes.py FILE.cbk [FILE.cbk ...]

Prints one table per file: kind (attention, mlp, embedding, lm_head, norms, other) x role (the stored tensor's role
in its layer: codes, codebook, codebook_u8, codebook_range, codebook_shared, row_scale, bias; "dense" for plain
tensors), bytes, MB (10^6), share of the file and bits per logical weight of that kind; then the header split into
its tokenizer JSON and the rest of the metadata.
"""
from __future__ import annotations

import json
import math
import sys

from trapetum.formats.cbk import CbkFile, tensor_kind


def breakdown(path: str) -> dict:
    """{"rows": [(kind, role, bytes, weights_of_kind)], "header": {...}, "file_bytes": int}."""
    f = CbkFile(path)
    sizes: dict[tuple[str, str], int] = {}
    weights: dict[str, int] = {}

    def nbytes(stored: str) -> int:
        t = f.tensors_table[stored]
        return t.end - t.begin

    for name in f.dense:
        k = tensor_kind(name)
        sizes[(k, "dense")] = sizes.get((k, "dense"), 0) + nbytes(name)
        weights[k] = weights.get(k, 0) + math.prod(f.tensors_table[name].shape)
    for name, layer in f.layers.items():
        k = tensor_kind(name)
        for role, stored in layer.tensors.items():
            sizes[(k, role)] = sizes.get((k, role), 0) + nbytes(stored)
        if layer.bias:
            sizes[(k, "bias")] = sizes.get((k, "bias"), 0) + nbytes(layer.bias)
        weights[k] = weights.get(k, 0) + math.prod(layer.shape)
    tok = f.meta.get("tokenizer") or {}
    tok_bytes = len(json.dumps(tok, ensure_ascii=True))  # as it sits (escaped again) inside the metadata string
    rows = [(k, r, b, weights[k]) for (k, r), b in sorted(sizes.items())]
    return {"rows": rows, "file_bytes": f.file_bytes,
            "header": {"bytes": f.header_bytes, "tokenizer_json_chars": tok_bytes}}


def main(argv: list[str]) -> int:
    for path in argv:
        d = breakdown(path)
        fb = d["file_bytes"]
        print(f"{path}: {fb:,} bytes ({fb / 1e6:.2f} MB)")
        print(f"  {'kind':10s} {'role':16s} {'bytes':>12s} {'MB':>8s} {'share':>7s} {'bits/weight':>11s}")
        for k, r, b, w in d["rows"]:
            print(f"  {k:10s} {r:16s} {b:12,d} {b / 1e6:8.2f} {100 * b / fb:6.1f}% {8 * b / max(w, 1):11.3f}")
        h = d["header"]
        print(f"  {'header':10s} {'(all)':16s} {h['bytes']:12,d} {h['bytes'] / 1e6:8.2f} {100 * h['bytes'] / fb:6.1f}%"
              f"   (tokenizer JSON ~{h['tokenizer_json_chars'] / 1e6:.2f} MB of it)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
