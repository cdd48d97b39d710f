"""trapetum info [MODEL]: architecture, parameter count, tensor formats, memory estimate."""
from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("info", help="describe a model file", description="Describe a model without running it.")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    from ._common import add_gpu_mem
    add_gpu_mem(p)
    p.add_argument("-c", "--ctx", type=int, default=None, metavar="N",
                   help="with --gpu-mem: the KV cache's positions (default: the model's context, at most 8192)")
    p.set_defaults(func=run)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _placement(ckpt, gpu_mem: float, ctx: int | None) -> dict:
    """The GPU engine's plan under ``gpu_mem`` GB (runtime/placement.py) and the bytes a decode step reads."""
    from ..api import ENGINE_MAX_LEN
    from ..errors import TrapetumError
    from ..runtime import placement as pl
    if ctx is not None and ctx < 1:
        raise TrapetumError(f"--ctx must be at least 1, got {ctx}")
    n = min(ckpt.config.context_length, ctx or ENGINE_MAX_LEN, ENGINE_MAX_LEN)
    p = pl.plan_for(ckpt, n, gpu_mem)
    gpu, host = pl.per_token(pl.checkpoint_sizes(ckpt), ckpt.config, p, pl.tied_dense(ckpt))
    return {"plan": p.describe(), "embed_host": p.embed_host, "experts_host": p.experts_host, "positions": n,
            "gpu_weight_bytes": p.gpu_bytes, "host_weight_bytes": p.host_bytes, "kv_bytes": p.kv_bytes,
            "gpu_bytes_per_token": gpu, "host_bytes_per_token": host}


def run(args) -> int:
    from ..formats.detect import describe_checkpoint, load_checkpoint
    from ..models.describe import describe  # not api: info needs no decoder nor kernels
    # without --gpu-mem, the description (no torch: tests/test_cli_startup.py); the placement reads the tensors
    ckpt = describe_checkpoint(args.model) if args.gpu_mem is None else load_checkpoint(args.model)
    info = describe(ckpt)
    if ckpt.source_format == "cbk":
        info["sizes"] = ckpt.meta["sizes"]
    if args.gpu_mem is not None:
        info["placement"] = _placement(ckpt, args.gpu_mem, args.ctx)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    cfg = ckpt.config
    print(f"model        {info['source']}")
    print(f"format       {info['format']}")
    print(f"architecture {cfg.family}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"ffn {cfg.intermediate_size}, heads {info['heads']}, vocab {cfg.vocab_size}")
    quirks = [k for k in ("qkv_bias", "qk_norm", "sandwich_norms", "tie_word_embeddings") if getattr(cfg, k)]
    if cfg.sliding_window:
        quirks.append(f"sliding window {cfg.sliding_window} on {cfg.layer_types.count('sliding')} layers")
    if cfg.attn_softcap or cfg.final_softcap:
        quirks.append(f"softcaps {cfg.attn_softcap}/{cfg.final_softcap}")
    if cfg.rope_scaling:
        quirks.append(f"rope {cfg.rope_scaling.get('rope_type')}")
    print(f"quirks       {', '.join(quirks) or 'none'}; act {cfg.hidden_act}; rope theta {cfg.rope_theta:g}")
    print(f"parameters   {info['parameters']:,}")
    moe, mla = info.get("moe"), info.get("mla")
    if moe:
        shared = f", shared expert ffn {moe['shared_intermediate_size']}" if moe["shared_intermediate_size"] else ""
        groups = f" in {moe['groups'][1]} of {moe['groups'][0]} groups" if moe["choice"] != "greedy" else ""
        print(f"experts      {moe['experts']} routed, top-{moe['top_k']} ({moe['scoring']}, {moe['choice']}{groups}), "
              f"expert ffn {moe['expert_intermediate_size']}{shared}; {moe['moe_layers']} MoE layers, "
              f"{moe['dense_layers']} dense")
        print(f"active       {moe['active_parameters_per_token']:,} parameters per token "
              f"({moe['active_parameters_per_token'] / info['parameters']:.1%})")
    if mla:
        print(f"latent attn  q_lora_rank {mla['q_lora_rank'] or 'none'}, kv_lora_rank {mla['kv_lora_rank']}, "
              f"qk {mla['qk_nope_head_dim']} + rope {mla['qk_rope_head_dim']}, v {mla['v_head_dim']}; latent cache "
              f"{_size(mla['latent_cache_fp16_bytes_per_token'] * 1024)} per 1k positions (fp16)")
    print(f"context      {cfg.max_position_embeddings} positions")
    print("formats      " + ", ".join(f"{k} x{v}" for k, v in sorted(info["tensor_formats"].items())))
    print(f"memory       {_size(info['memory_fp16_weights_bytes'])} as fp16 weights; KV cache "
          f"{_size(info['kv_cache_fp16_bytes_per_token'] * 1024)} per 1k positions (fp16)")
    pl = info.get("placement")
    if pl:
        print(f"placement    --gpu-mem {args.gpu_mem:g}, {pl['positions']} positions: {pl['plan']}")
        print(f"per token    GPU {_size(pl['gpu_bytes_per_token'])}, host {_size(pl['host_bytes_per_token'])} of "
              "weights read per decode step")
    sizes = info.get("sizes")
    if sizes:
        print(f"file         {_size(sizes['file_bytes'])}, {sizes['file_bits_per_weight']:.3f} bits per weight overall")
        for kind, k in sizes["kinds"].items():
            fmts = ", ".join(f"{f} x{n}" for f, n in k["formats"].items())
            print(f"  {kind:11s} {_size(k['bytes']):>10s}  {k['bits_per_weight']:7.3f} bits/weight  ({fmts})")
    recipe = ckpt.meta.get("recipe")
    if recipe:
        brief = {k: v for k, v in recipe.items() if k not in ("layer_errors", "bits_per_weight")}
        print("recipe       " + json.dumps(brief, default=str))
        errs = recipe.get("layer_errors") or {}
        if errs:
            worst = max(errs, key=errs.get)
            print(f"errors       {len(errs)} layers, mean relative error {sum(errs.values()) / len(errs):.4f}, "
                  f"worst {worst} {errs[worst]:.4f} (--json for all)")
    prov = ckpt.meta.get("provenance")
    if prov:
        print("provenance   " + json.dumps(prov, default=str))
    return 0
