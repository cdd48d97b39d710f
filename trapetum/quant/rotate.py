"""Function-preserving rotation of a dense decoder: "fair sources" without the source file's quantization grid.

A GGUF source whose weights sit on a per-block 4-bit grid favours any quantizer that can re-express that grid
(a block format like Q4_K does, a per-row codebook does not). This transform computes the same function with
dense weights (QuaRot-style), so that every quantizer starts from the same grid-free file:

* **Norm folding** (dense ``Q``): each pre-norm's scale ``s = norm_offset + w`` is folded into the columns of the
  projections that read it (q/k/v, gate/up; the final norm into the LM head), and the norm's weight becomes
  neutral (``s = 1``). RMSNorm without a weight commutes with any orthogonal map.
* **Residual rotation** ``x' = Q^T x`` with a seeded orthogonal ``Q`` [D, D] (``W -> W Q`` for the readers of the
  residual, ``W -> Q^T W`` for its writers o/down, ``E -> E Q`` for the embedding). Families with sandwich norms
  (Gemma-2/3) scale the *writes* to the residual after a norm (``x + diag(s) n(Wo a)``), which no dense
  rotation commutes with; there ``Q`` is a random **signed permutation** (``Q^T diag(s) Q`` stays diagonal), and
  every norm, pre-norms and final norm included, stays with its weights permuted: nothing is folded. Folding there
  would hand the readers' columns the pre-norm weights' spread (4-7x max/median on Gemma-3-270M,
  scripts/dev/gguf_norm_spread.py), which a permutation does not blend and which broke every quantizer of the
  folded fair source (QUALITY.md, session 17). Tied embeddings stay tied.
* **Head rotation** (``heads=True``): per KV head a seeded orthogonal ``H`` [hd, hd] rotates the value space
  (``Wv -> H^T Wv`` on the head's rows, ``Wo -> Wo H`` on the columns of every query head of the group).
  Attention mixes values linearly over positions, so this is exact; q/k are left alone (RoPE, q/k norms).
* **MLP permutation** (``mlp_perm=True``): a seeded permutation of the intermediate units (gate/up rows, down
  columns). The activation is elementwise, so only permutations commute with it (QuaRot's MLP rotation needs an
  online Hadamard, which no file format here can express).

With a dense ``Q`` every stored matrix is mixed on one side (q/k/v/gate/up/head on the input side, o/down/
embedding rows through ``Q``), so none keeps its source grid. With the signed permutation (Gemma) the permutations
break the block alignment of q/k/v/gate/up/down/embedding and v/o are rotated, but the values of every matrix
other than v/o stay source values (signs flipped), scattered over new blocks: say so next to Gemma's figures.

Tied embeddings: with a dense ``Q`` the folded final norm unties the head (``lm_head = E diag(s) Q``, written as
its own tensor). Arithmetic is float64 on each tensor; results are float32 (the exporters round to fp16).
The transform is lazy: ``rotate_checkpoint`` returns a Checkpoint whose tensors are computed on access.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import UnsupportedError
from ..models.checkpoint import Checkpoint, LazyTensors
from ..models.config import ModelConfig

ROTATIONS = ("orthogonal", "hadamard")
DENSE_FAMILIES = ("llama", "mistral", "qwen2", "gemma2", "gemma3")


@dataclass(frozen=True)
class RotateSpec:
    seed: int = 0
    rotation: str = "orthogonal"  # "orthogonal" (Haar-random) or "hadamard" (randomized, dimension a power of 2)
    heads: bool = True  # rotate each KV head's value space (v rows, o columns)
    mlp_perm: bool = True  # permute the MLP's intermediate units

    def validate(self) -> "RotateSpec":
        if self.rotation not in ROTATIONS:
            raise UnsupportedError(f"--rotation must be one of {', '.join(ROTATIONS)}, got {self.rotation!r}")
        return self


def random_orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    """A Haar-random orthogonal matrix [n, n], float64 (QR of a Gaussian with the signs of R's diagonal fixed)."""
    a = torch.randn(n, n, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(n, dtype=torch.float64))


def hadamard(n: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix [n, n] / sqrt(n), float64; n a power of 2."""
    if n < 1 or n & (n - 1):
        raise UnsupportedError(f"--rotation hadamard needs a power-of-2 dimension, got {n} (use orthogonal)")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def rotation(n: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "hadamard":
        signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
        return hadamard(n) * signs[:, None]  # diag(signs) H: orthogonal, rows of H sign-flipped
    return random_orthogonal(n, gen)


def signed_permutation(n: int, gen: torch.Generator) -> torch.Tensor:
    """A random signed permutation matrix [n, n], float64 (Q[perm[j], j] = +-1)."""
    perm = torch.randperm(n, generator=gen)
    signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
    q = torch.zeros(n, n, dtype=torch.float64)
    q[perm, torch.arange(n)] = signs
    return q


def check_supported(cfg: ModelConfig, where: str) -> None:
    dense = all(cfg.block_kinds(i) == ("attention", "mlp") for i in range(cfg.num_layers))
    if cfg.family not in DENSE_FAMILIES or not dense:
        raise UnsupportedError(f"{where}: rotate supports dense models of the families "
                               f"{', '.join(DENSE_FAMILIES)}, not this {cfg.family} model")


@dataclass
class _Maps:
    """The seeded matrices of one transform (float64)."""
    Q: torch.Tensor  # [D, D] residual map
    dense: bool  # Q is a dense rotation (else a signed permutation)
    heads: list[torch.Tensor] | None  # per KV head [hd, hd]
    perms: list[torch.Tensor] | None  # per layer, permutation of the intermediate units [I]


def make_maps(cfg: ModelConfig, spec: RotateSpec) -> _Maps:
    gen = torch.Generator().manual_seed(int(spec.seed))
    dense = not cfg.sandwich_norms
    Q = rotation(cfg.hidden_size, spec.rotation, gen) if dense else signed_permutation(cfg.hidden_size, gen)
    heads = None
    if spec.heads:
        heads = [rotation(cfg.head_dim, spec.rotation, gen) for _ in range(cfg.num_layers * cfg.num_kv_heads)]
    perms = [torch.randperm(cfg.intermediate_size, generator=gen) for _ in range(cfg.num_layers)] \
        if spec.mlp_perm else None
    return _Maps(Q, dense, heads, perms)


def rotated_config(cfg: ModelConfig) -> ModelConfig:
    """The config of the rotated model: a dense rotation unties the head; nothing else changes."""
    return dataclasses.replace(cfg, tie_word_embeddings=cfg.tie_word_embeddings and cfg.sandwich_norms)


def rotate_checkpoint(ckpt: Checkpoint, spec: RotateSpec = RotateSpec()) -> Checkpoint:
    """The rotated model as a lazy Checkpoint (float32 tensors, canonical names; module doc)."""
    spec.validate()
    cfg = ckpt.config
    check_supported(cfg, ckpt.source)
    maps = make_maps(cfg, spec)
    src = ckpt.tensors
    get_src: Callable[[str], torch.Tensor] = lambda n: src[n].to(torch.float64)  # noqa: E731
    getters = _getters(cfg, maps, get_src, set(src))
    new_cfg = rotated_config(cfg)
    shapes = dict(getattr(src, "shapes", {}) or {})
    if not new_cfg.tie_word_embeddings and "lm_head.weight" not in shapes:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    formats = {n: "F32" for n in getters}
    meta = dict(ckpt.meta)
    meta["rotation"] = {"seed": spec.seed, "rotation": spec.rotation, "heads": spec.heads, "mlp_perm": spec.mlp_perm,
                        "residual": "dense" if maps.dense else "signed permutation", "source": ckpt.source}
    return Checkpoint(config=new_cfg, tensors=LazyTensors(getters, formats=formats, shapes=shapes),
                      tokenizer=ckpt.tokenizer, source=ckpt.source, source_format=ckpt.source_format,
                      generation=dict(ckpt.generation), meta=meta)


def _getters(cfg: ModelConfig, m: _Maps, get: Callable[[str], torch.Tensor],
             names: set[str]) -> dict[str, Callable[[], torch.Tensor]]:
    off = float(cfg.norm_offset)
    Q = m.Q
    out: dict[str, Callable[[], torch.Tensor]] = {}

    def f32(fn):
        return lambda: fn().to(torch.float32).contiguous()

    def scale(norm: str) -> torch.Tensor:
        return off + get(norm + ".weight")

    def neutral(norm: str) -> Callable[[], torch.Tensor]:
        return lambda: torch.full_like(get(norm + ".weight"), 1.0 - off)

    def permuted_norm(norm: str) -> Callable[[], torch.Tensor]:
        # post-norm scales under a signed permutation: diag(Q^T diag(s) Q)
        return lambda: (Q.T @ torch.diag(scale(norm)) @ Q).diagonal() - off

    def reader(w: str, norm: str, perm: torch.Tensor | None = None):
        def fn():
            x = (get(w) * scale(norm)[None, :] if m.dense else get(w)) @ Q  # W diag(s) Q (dense), W Q (signed perm)
            return x[perm] if perm is not None else x
        return fn

    # the pre-norms: folded into the readers under a dense Q; kept (permuted) under a signed permutation
    pre_norm = neutral if m.dense else permuted_norm

    kvh, hd, H = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    group = H // kvh
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a, mlp = p + "self_attn.", p + "mlp."
        hs = m.heads[i * kvh:(i + 1) * kvh] if m.heads is not None else None
        perm = m.perms[i] if m.perms is not None else None
        out[p + "input_layernorm.weight"] = pre_norm(p + "input_layernorm")
        out[a + "q_proj.weight"] = reader(a + "q_proj.weight", p + "input_layernorm")
        out[a + "k_proj.weight"] = reader(a + "k_proj.weight", p + "input_layernorm")

        def v_w(a=a, p=p, hs=hs):
            w = reader(a + "v_proj.weight", p + "input_layernorm")()  # [kvh hd, D]
            if hs is not None:
                w = torch.cat([hs[g].T @ w[g * hd:(g + 1) * hd] for g in range(kvh)])
            return w
        out[a + "v_proj.weight"] = v_w
        for b in ("q", "k", "v"):
            if a + f"{b}_proj.bias" in names:
                if b == "v" and hs is not None:
                    out[a + "v_proj.bias"] = (lambda a=a, hs=hs: torch.cat(
                        [hs[g].T @ get(a + "v_proj.bias")[g * hd:(g + 1) * hd] for g in range(kvh)]))
                else:
                    out[a + f"{b}_proj.bias"] = (lambda n=a + f"{b}_proj.bias": get(n))

        def o_w(a=a, hs=hs):
            w = Q.T @ get(a + "o_proj.weight")  # [D, H hd]
            if hs is not None:
                w = torch.cat([w[:, j * hd:(j + 1) * hd] @ hs[j // group] for j in range(H)], 1)
            return w
        out[a + "o_proj.weight"] = o_w
        if a + "o_proj.bias" in names:
            out[a + "o_proj.bias"] = lambda a=a: Q.T @ get(a + "o_proj.bias")
        if cfg.qk_norm:
            out[a + "q_norm.weight"] = lambda a=a: get(a + "q_norm.weight")
            out[a + "k_norm.weight"] = lambda a=a: get(a + "k_norm.weight")
        if cfg.sandwich_norms:
            mlp_norm = p + "pre_feedforward_layernorm"
            out[p + "post_attention_layernorm.weight"] = permuted_norm(p + "post_attention_layernorm")
            out[p + "post_feedforward_layernorm.weight"] = permuted_norm(p + "post_feedforward_layernorm")
        else:
            mlp_norm = p + "post_attention_layernorm"
        out[mlp_norm + ".weight"] = pre_norm(mlp_norm)
        out[mlp + "gate_proj.weight"] = reader(mlp + "gate_proj.weight", mlp_norm, perm)
        out[mlp + "up_proj.weight"] = reader(mlp + "up_proj.weight", mlp_norm, perm)
        for b in ("gate", "up"):
            if mlp + f"{b}_proj.bias" in names:
                out[mlp + f"{b}_proj.bias"] = (lambda n=mlp + f"{b}_proj.bias", perm=perm:
                                               get(n)[perm] if perm is not None else get(n))

        def down_w(mlp=mlp, perm=perm):
            w = get(mlp + "down_proj.weight")
            return Q.T @ (w[:, perm] if perm is not None else w)
        out[mlp + "down_proj.weight"] = down_w
        if mlp + "down_proj.bias" in names:
            out[mlp + "down_proj.bias"] = lambda mlp=mlp: Q.T @ get(mlp + "down_proj.bias")

    out["model.embed_tokens.weight"] = lambda: get("model.embed_tokens.weight") @ Q
    head_src = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    if m.dense:
        out["model.norm.weight"] = neutral("model.norm")
        out["lm_head.weight"] = lambda: get(head_src) * scale("model.norm")[None, :] @ Q
    else:
        out["model.norm.weight"] = permuted_norm("model.norm")
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = lambda: get(head_src) @ Q
    missing = set(out) - names - {"lm_head.weight"}
    if missing:
        raise UnsupportedError(f"rotate: the source lacks {sorted(missing)[0]} (an unsupported block layout)")
    extra = names - set(out)
    if extra:
        raise UnsupportedError(f"rotate: the source has tensors this transform does not map ({sorted(extra)[0]})")
    return {n: f32(fn) for n, fn in out.items()}
