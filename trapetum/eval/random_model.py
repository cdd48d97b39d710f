"""Checkpoints of random weights at real model shapes, generated on the device tensor by tensor (GPU speed work:
nothing to download or send, and the engine builds from them exactly as from a file).

    SHAPES                     model name -> ModelConfig fields (Llama-2-7B, Llama-3-8B, Llama-2-70B,
                               Llama-3.2-1B, Qwen2.5-0.5B, Mixtral-8x7B, DeepSeek-V2-Lite, DeepSeek-V3)
    random_checkpoint(shape, fmt, device)
        fmt "fp16"      dense fp16 projections and head
            "cb4"       4-bit per-row codebook projections, 8-bit codebook head (records as a .cbk holds them)
            "aqlm-2x8"  AQLM 2x8 / "aqlm-1x16" 1x16 projections (random codes, codebooks, scales), fp16 head
        the embedding is a dense fp16 table, norms are ones; each tensor is generated when the engine reads it
        (seeded by its name: the same weights every run).
    random_sizes(shape, fmt)   name -> bytes of each tensor's engine form (runtime/placement.py ``engine_bytes``),
                               from the shapes alone: nothing generated (what a benchmark checks against the host
                               RAM and the GPU before it builds)
"""
from __future__ import annotations

import math
import zlib

import torch

from ..models.checkpoint import Checkpoint, LazyTensors
from ..models.config import ModelConfig
from ..models.schema import expected_shapes
from ..schemes.record import QuantRecord

SHAPES = {
    "llama2-7b": dict(family="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                      num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=4096),
    "llama3-8b": dict(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
                      rope_theta=500000.0),
    "llama2-70b": dict(family="llama", vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80,
                       num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=4096),
    # Llama-3.2-1B's shape with an untied head (the published model ties it; a drafter file with its own
    # quantized head reads fewer bytes per step than the fp16 embedding table would)
    "llama3.2-1b": dict(family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                        num_heads=32, num_kv_heads=8, head_dim=64, max_position_embeddings=8192, rope_theta=500000.0),
    "qwen2.5-0.5b": dict(family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                         num_heads=14, num_kv_heads=2, head_dim=64, max_position_embeddings=8192,
                         rope_theta=1000000.0, qkv_bias=True, tie_word_embeddings=True),
    # mixture of experts (issue 17): every expert a projection of the format, routers dense fp16
    "mixtral-8x7b": dict(family="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
                         num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=32768,
                         rope_theta=1000000.0, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336,
                         mlp_types=["moe"] * 32, norm_topk_prob=True),
    # DeepSeek-V2-Lite: latent attention (no q_lora), 64 routed experts top-6 + 2 shared, the first layer dense
    "deepseek-v2-lite": dict(
        family="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_layers=27,
        num_heads=16, num_kv_heads=16, head_dim=192, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                      "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
        attn_scale=192 ** -0.5 * (0.1 * 0.707 * math.log(40.0) + 1.0) ** 2, kv_lora_rank=512, qk_rope_head_dim=64,
        v_head_dim=128, rope_interleave=True, num_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
        mlp_types=["dense"] + ["moe"] * 26, shared_expert_intermediate_size=2 * 1408),
    # DeepSeek-V3 (671B; R1 has the same shape): latent attention with q_lora, 256 routed experts top-8 + 1 shared,
    # sigmoid scores with the correction bias, noaux_tc routing over 8 groups (top 4), the first 3 layers dense;
    # these are the fields config_from_hf makes of its published config.json (tests/test_offload_shapes.py)
    "deepseek-v3": dict(
        family="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_layers=61,
        num_heads=128, num_kv_heads=128, head_dim=192, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_scaling={"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
        attn_scale=192 ** -0.5 * (0.1 * math.log(40.0) + 1.0) ** 2, q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=2048, mlp_types=["dense"] * 3 + ["moe"] * 58, shared_expert_intermediate_size=2048,
        router_scoring="sigmoid", router_topk="noaux_tc", n_group=8, topk_group=4, router_bias=True,
        norm_topk_prob=True, routed_scaling_factor=2.5),
}
FORMATS = ("fp16", "cb4", "aqlm-2x8", "aqlm-1x16")
AQLM = {"aqlm-2x8": (2, 8), "aqlm-1x16": (1, 16)}


def _gen(name: str, device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))


def random_codebook(out_f: int, in_f: int, bits: int, device, g: torch.Generator) -> QuantRecord:
    per = 8 // bits
    codes = torch.randint(0, 256, (out_f, -(-in_f // per)), dtype=torch.uint8, device=device, generator=g)
    cb = (torch.randn(out_f, 1 << bits, device=device, generator=g).sort(dim=1).values * 0.02).to(torch.float16)
    return QuantRecord("codebook", (out_f, in_f), {"bits": bits}, {"codes": codes, "codebook": cb})


def random_aqlm(out_f: int, in_f: int, fmt: str, device, g: torch.Generator) -> QuantRecord:
    M, nbits = AQLM[fmt]
    half = 1 << (nbits - 1)
    codes = torch.randint(-half, half, (out_f, in_f // 8, M), device=device, generator=g,
                          dtype=torch.int8 if nbits == 8 else torch.int16)
    cb = torch.randn(M, 1 << nbits, 1, 8, device=device, generator=g).half()
    scales = torch.full((out_f, 1, 1, 1), 0.02 / M ** 0.5, device=device, dtype=torch.float16)
    return QuantRecord("aqlm", (out_f, in_f), {"num_codebooks": M, "nbits": nbits, "in_group_size": 8,
                                               "out_group_size": 1},
                       {"codes": codes, "codebooks": cb, "scales": scales})


def shape_config(shape: str, layers: int | None = None, overrides: dict | None = None) -> ModelConfig:
    """The ModelConfig of ``shape`` (the first ``layers`` layers; ``overrides`` replace fields)."""
    if shape not in SHAPES:
        raise ValueError(f"shape: one of {', '.join(SHAPES)}, got {shape!r}")
    fields = dict(SHAPES[shape], **(overrides or {}))
    if layers:
        if not 0 < layers <= fields["num_layers"]:
            raise ValueError(f"layers: 1 to {fields['num_layers']} for {shape}, got {layers}")
        fields["num_layers"] = layers
        if "mlp_types" in fields:
            fields["mlp_types"] = fields["mlp_types"][:layers]
    return ModelConfig(**fields).validate(shape)


def _kind(name: str, shp: tuple[int, ...], fmt: str) -> str:
    """What random_checkpoint makes of a tensor: "vector" (norms, ones; biases, zeros), "fp16", "cb4" / "cb8"
    (per-row codebooks; the head 8-bit) or the AQLM format."""
    if len(shp) == 1:
        return "vector"
    if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):  # routers stay dense
        return "fp16"
    if name == "model.embed_tokens.weight" or fmt == "fp16" or (fmt.startswith("aqlm") and name == "lm_head.weight"):
        return "fp16"
    if fmt == "cb4":
        return "cb8" if name == "lm_head.weight" else "cb4"
    return fmt


def _engine_bytes(kind: str, shp: tuple[int, ...]) -> int:
    """runtime/placement.py ``engine_bytes`` of the tensor random_checkpoint makes, from its shape."""
    numel = math.prod(shp)
    if kind in ("vector", "fp16"):
        return numel * 2
    if kind in ("cb4", "cb8"):
        bits = int(kind[2])
        return shp[0] * -(-shp[1] // (8 // bits)) + shp[0] * (2 << bits)
    M, nbits = AQLM[kind]
    return shp[0] * (shp[1] // 8) * M * (nbits // 8) + M * (1 << nbits) * 8 * 2 + shp[0] * 2


def random_sizes(shape: str, fmt: str, layers: int | None = None, overrides: dict | None = None) -> dict[str, int]:
    """Name -> engine bytes of every tensor ``random_checkpoint`` would make (module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt: one of {', '.join(FORMATS)}, got {fmt!r}")
    shapes = expected_shapes(shape_config(shape, layers, overrides))
    return {name: _engine_bytes(_kind(name, shp, fmt), shp) for name, shp in shapes.items()}


def random_checkpoint(shape: str, fmt: str, device="cuda", layers: int | None = None,
                      overrides: dict | None = None, host_names: tuple[str, ...] = ()) -> Checkpoint:
    """(``layers``: fewer layers than the model has, for tests at the real per-layer shapes; ``overrides``:
    ModelConfig fields that replace the shape's, e.g. a tokenizer's ``vocab_size`` or a tiny test shape;
    ``host_names``: dense tensors handed out on the CPU, as a file's mmapped tensors are, so that a table the engine
    keeps in host RAM takes no GPU memory while the model is built; generated on ``device`` all the same, so the
    values do not change.)"""
    if fmt not in FORMATS:
        raise ValueError(f"fmt: one of {', '.join(FORMATS)}, got {fmt!r}")
    cfg = shape_config(shape, layers, overrides)

    def make(name: str, shp: tuple[int, ...]):
        def get():
            g = _gen(name, device)
            kind = _kind(name, shp, fmt)
            if kind == "vector":
                return (torch.zeros if name.endswith("e_score_correction_bias") else torch.ones)(shp, device=device)
            if kind == "fp16":
                t = torch.randn(shp, device=device, dtype=torch.float16, generator=g) * 0.02
                return t.cpu() if name in host_names else t
            if kind in ("cb4", "cb8"):
                return random_codebook(shp[0], shp[1], int(kind[2]), device, g)
            return random_aqlm(shp[0], shp[1], fmt, device, g)
        return get

    shapes = expected_shapes(cfg)
    getters = {name: make(name, shp) for name, shp in shapes.items()}
    return Checkpoint(cfg, LazyTensors(getters, shapes=shapes), None, f"random:{shape}:{fmt}", "random")
