"""Placement of a checkpoint's tensors between the GPU and host RAM under a GPU memory budget (``--gpu-mem GB``).

    plan(sizes, cfg, kv_bytes, budget, margin=MARGIN, tied_dense_embed=False, source="model") -> Placement
    per_token(sizes, cfg, placement, tied_dense_embed=False) -> (GPU bytes, host bytes) a decode step reads

``sizes``: canonical tensor name -> bytes of its engine form on the GPU (``engine_bytes``: a dense tensor as fp16,
a codebook record as its codes plus the fp16 codebook, other records as stored; ``checkpoint_sizes`` reads them
from the storage labels and shapes where they say enough). What must fit: the weights on the
GPU + the KV cache + ``margin`` (activations, workspaces, graphs, the CUDA context) <= ``budget``. The planner moves
tensors to host RAM in a fixed order and stops as soon as the rest fits:
    1. the embedding table (the step's input rows gathered on the host and uploaded, one row per token; a table the
       LM head shares as its dense weight stays on the GPU for the head, so moving it saves nothing: skipped);
    2. every MoE layer's routed experts (run by the host GEMV kernels, runtime/host_experts.py); the routers,
       shared experts, attention and dense layers stay on the GPU;
and otherwise refuses with one line naming the budget and what the model needs with both moved
(``PlacementError``). No budget (None): everything on the GPU (``ON_DEVICE``), the engine as it always was.
Whole layers on the CPU are not planned (not built yet).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import TrapetumError
from ..models.config import ModelConfig

GIB = 1 << 30
MARGIN = GIB  # room left for activations, workspaces, CUDA graphs and the context
EMBED = "model.embed_tokens.weight"


class PlacementError(TrapetumError):
    """The model does not fit the GPU budget even with everything movable in host RAM (one line)."""


@dataclass(frozen=True)
class Placement:
    """Where the engine keeps its tensors: ``embed_host`` the embedding table, ``experts_host`` every MoE layer's
    routed experts; the byte accounting of the plan (0 when not planned)."""
    embed_host: bool = False
    experts_host: bool = False
    gpu_bytes: int = 0   # weights on the GPU
    host_bytes: int = 0  # weights in host RAM
    kv_bytes: int = 0
    margin: int = 0
    budget: int | None = None

    @property
    def offloads(self) -> bool:
        return self.embed_host or self.experts_host

    def describe(self) -> str:
        """One line: what lives where, in GB."""
        where = [n for n, on in (("embedding", self.embed_host), ("routed experts", self.experts_host)) if on]
        head = "everything on the GPU" if not where else " and ".join(where) + " in host RAM"
        if self.budget is None:
            return head
        return (f"{head}: GPU {gb(self.gpu_bytes + self.kv_bytes + self.margin)} GB of {gb(self.budget)} (weights "
                f"{gb(self.gpu_bytes)}, KV cache {gb(self.kv_bytes)}, margin {gb(self.margin)}), host "
                f"{gb(self.host_bytes)} GB")


ON_DEVICE = Placement()


def gb(n: int) -> str:
    return f"{n / GIB:.2f}"


def is_routed_expert(name: str) -> bool:
    """Whether ``name`` is a tensor of a routed expert (models/schema.py ``expert_names``)."""
    return ".mlp.experts." in name


def engine_bytes(weight) -> int:
    """Bytes of the engine form of a stored tensor or QuantRecord (module docstring; biases left out: a label does
    not show them, and they are a row's worth of bytes)."""
    if isinstance(weight, torch.Tensor):
        return weight.numel() * 2
    if weight.scheme == "codebook":  # the codes and the fp16 [out, 2**bits] codebook (a compact one expanded)
        codes = weight.tensors["codes"]
        return codes.numel() * codes.element_size() + weight.shape[0] * (2 << weight.params["bits"])
    return sum(t.numel() * t.element_size() for t in weight.tensors.values() if isinstance(t, torch.Tensor))


def _label_bytes(label: str, shape: tuple[int, ...]) -> int | None:
    """Bytes from a storage label (formats' ``LazyTensors.formats``) and a logical shape, where the label says
    enough (codebooks; dense floats); None otherwise."""
    numel = 1
    for s in shape:
        numel *= int(s)
    if label.startswith("codebook-") and label.endswith("bit") and len(shape) == 2:
        bits = int(label[len("codebook-"):-3])
        per = 8 // bits if 8 % bits == 0 else None
        if per is None:
            return None
        return shape[0] * -(-shape[1] // per) + shape[0] * (2 << bits)
    if label.upper() in ("F16", "BF16", "F32", "F64", "FLOAT16", "BFLOAT16", "FLOAT32", "FLOAT64") or \
            label in ("torch.float16", "torch.bfloat16", "torch.float32"):
        return numel * 2
    return None


def checkpoint_sizes(ckpt) -> dict[str, int]:
    """Engine bytes of every tensor of ``ckpt``: from its storage labels and shapes where they say enough, else by
    reading the tensor (one at a time, dropped)."""
    t = ckpt.tensors
    labels, shapes = getattr(t, "formats", {}) or {}, getattr(t, "shapes", {}) or {}
    out = {}
    for name in t:
        n = None
        if name in labels and name in shapes:
            n = _label_bytes(str(labels[name]), tuple(shapes[name]))
        out[name] = n if n is not None else engine_bytes(t[name])
    return out


def kv_bytes(cfg: ModelConfig, max_len: int, latent: bool = False) -> int:
    """Bytes of the engine's KV cache (runtime/kv.py ContiguousKV, as runtime/engine.py sizes it)."""
    if latent:
        return cfg.num_layers * max_len * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    hd = max(cfg.head_dim, cfg.v_head_dim) if cfg.mla else cfg.head_dim
    return 2 * cfg.num_layers * cfg.num_kv_heads * max_len * hd * 2


def plan(sizes: dict[str, int], cfg: ModelConfig, kv: int, budget: int | None, margin: int = MARGIN,
         tied_dense_embed: bool = False, source: str = "model") -> Placement:
    """The Placement of the module docstring; PlacementError when nothing fits."""
    if budget is None:
        return ON_DEVICE
    if budget <= 0:
        raise PlacementError(f"--gpu-mem: the budget must be positive, got {budget / GIB:g} GB")
    embed = 0 if tied_dense_embed else sizes.get(EMBED, 0)
    experts = sum(n for name, n in sizes.items() if is_routed_expert(name)) if cfg.moe else 0
    total = sum(sizes.values())
    steps = [(False, False, 0)]
    if embed:
        steps.append((True, False, embed))
    if experts:
        steps.append((bool(embed), True, embed + experts))
    for e_host, x_host, moved in steps:
        if total - moved + kv + margin <= budget:
            return Placement(e_host, x_host, total - moved, moved, kv, margin, budget)
    moved = steps[-1][2]
    what = {0: "", 1: " even with its embedding in host RAM", 2: " even with its routed experts in host RAM",
            3: " even with its embedding and routed experts in host RAM"}[bool(embed) + 2 * bool(experts)]
    need = total - moved + kv + margin
    raise PlacementError(f"--gpu-mem {budget / GIB:g} GB: {source} needs {gb(need)} GB on the GPU{what} (weights "
                         f"{gb(total - moved)} GB, KV cache {gb(kv)} GB, margin {gb(margin)} GB)")


def per_token(sizes: dict[str, int], cfg: ModelConfig, placement: Placement, tied_dense_embed: bool = False
              ) -> tuple[int, int]:
    """(GPU bytes, host bytes) of weights one decode step reads: every tensor on its side once, except the
    embedding table (one row; the whole table when the dense head shares it) and the routed experts (top-k of E
    per MoE layer, on average k / E of their bytes)."""
    row = cfg.hidden_size * 2
    embed = sizes.get(EMBED, 0)
    experts = sum(n for name, n in sizes.items() if is_routed_expert(name)) if cfg.moe else 0
    rest = sum(sizes.values()) - embed - experts
    routed = experts * cfg.num_experts_per_tok // max(cfg.num_experts, 1) if cfg.moe else 0
    gpu, host = rest, 0
    if tied_dense_embed:
        gpu += embed
    elif placement.embed_host:
        host += row
    else:
        gpu += row
    if placement.experts_host:
        host += routed
    else:
        gpu += routed
    return gpu, host


def tied_dense(ckpt) -> bool:
    """Whether the LM head is the checkpoint's dense embedding table (the table then stays on the GPU)."""
    cfg = ckpt.config
    return bool(cfg.tie_word_embeddings) and "lm_head.weight" not in ckpt.tensors and isinstance(
        ckpt.tensors[EMBED], torch.Tensor)


def plan_for(ckpt, max_len: int, gpu_mem_gb: float | None, latent: bool = False, margin: int = MARGIN) -> Placement:
    """The plan of checkpoint ``ckpt`` with a KV cache of ``max_len`` positions under ``gpu_mem_gb`` GB (None:
    everything on the GPU, nothing read)."""
    if gpu_mem_gb is None:
        return ON_DEVICE
    cfg = ckpt.config
    return plan(checkpoint_sizes(ckpt), cfg, kv_bytes(cfg, max_len, latent), int(gpu_mem_gb * GIB), margin,
                tied_dense_embed=tied_dense(ckpt), source=ckpt.source)
