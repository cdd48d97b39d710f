"""Run-time zero fraction of each sparsity site (rows 1.., position 0 is dense) over a text's first tokens.

    python3 scripts/sparsity_achieved.py MODEL THRESHOLDS [--text FILE] [--tokens 512]

THRESHOLDS: a side file or "on" (a .cbk's section). Counts, for every layer's q_proj, o_proj, gate_proj and
down_proj input, the entries that are exactly zero in one prompt forward of the reference decoder (CPU), and
prints the fraction per site: whether the calibration's target sparsity holds on other text.
"""
from __future__ import annotations

import argparse

import trapetum
from trapetum.eval.perplexity import tokenize_file


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("thresholds")
    p.add_argument("--text", default="../shared/data/wikitext-2-raw/wiki.test.raw")
    p.add_argument("--tokens", type=int, default=512)
    a = p.parse_args()
    m = trapetum.load(a.model, sparsity=a.thresholds)
    ids = tokenize_file(m.tokenizer, a.text)[:a.tokens].tolist()
    z = {s: [0, 0] for s in ("qkv", "o", "gate_up", "down")}
    hooks = []
    for b in m.decoder.model.layers:
        for s, mod in (("qkv", b.self_attn.q_proj), ("o", b.self_attn.o_proj), ("gate_up", b.mlp.gate_proj),
                       ("down", b.mlp.down_proj)):
            def count(mod, args, s=s):
                x = args[0][:, 1:]
                z[s][0] += int((x == 0).sum())
                z[s][1] += x.numel()
            hooks.append(mod.register_forward_pre_hook(count))
    m.logits(ids)
    for h in hooks:
        h.remove()
    print(a.thresholds, {s: round(n / d, 4) for s, (n, d) in z.items()})


if __name__ == "__main__":
    main()
