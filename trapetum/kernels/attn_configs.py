"""Launch configurations of the split-KV decode attention (kernels/attention.py): the AttnConfig knobs, the static
resource rule that keeps a config inside shared memory and registers, the tuning data (the candidates the sweep
times, the production picks) and the rule that chooses one.

The figures behind the rule (which config won at which shape on the H200) are in NOTES-engine.md and
BENCHMARKS.md; `python scripts/attn_sweep.py --out DIR` measures them again.
"""
from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class AttnConfig:
    """Launch configuration of the split-KV kernels.

    chunk         positions per split program = the workspace's chunk (one (max, sum, out) per chunk)
    block_n       positions loaded per step inside a split program (chunk is a multiple of it;
                  chunk > block_n makes an inner loop, software-pipelined over `stages`)
    warps         num_warps of the split kernel
    stages        num_stages of the split kernel (matters only with the inner loop)
    merge_chunks  largest number of chunks the merge folds in per step (capped at the chunk count)
    merge_warps   num_warps of the merge kernel
    merge_d       head-dim columns per merge program (0: the whole head, one program per head)
    splits        0: fixed chunks of `chunk` positions (grid Hkv x ceil(T_max / chunk)). P > 0: P programs
                  per kv head whose chunks adapt to the run-time length: ceil(span / P) positions rounded
                  up to block_n, at least `chunk` (an inner loop of a run-time trip count; attention.py)
    """
    chunk: int = 64
    block_n: int = 64
    warps: int = 4
    stages: int = 1
    merge_chunks: int = 16
    merge_warps: int = 4
    merge_d: int = 0
    splits: int = 0

    @property
    def name(self) -> str:
        s = (f"p{self.splits}" if self.splits else "") + f"c{self.chunk}"
        s += f"b{self.block_n}s{self.stages}" if loops(self) else ""
        return s + f"-w{self.warps}-m{self.merge_chunks}w{self.merge_warps}d{self.merge_d or 'all'}"


def loops(cfg: AttnConfig) -> bool:
    """Whether a split program walks its chunk in a loop of block_n steps (else: one tile)."""
    return cfg.splits > 0 or cfg.chunk > cfg.block_n


def n_chunks(cfg: AttnConfig, t_max: int) -> int:
    """Split programs per kv head = workspace chunks per query head for a cache of t_max positions: one per
    chunk of the cache, or the config's splits (no more than chunks of `chunk` positions fit in t_max: the
    adaptive chunks are never shorter)."""
    n = -(-t_max // cfg.chunk)
    return min(cfg.splits, n) if cfg.splits else n


# ----------------------------------------------------------------------------- tuning data
LEGACY_CONFIG = AttnConfig()  # the kernel before configs: 64-position chunks, 4 warps, merge 16 per step
# 8 length-adaptive splits per kv head: 512-position chunks at 4k, 64-position ones at <= 512 positions
SPLIT8_CONFIG = AttnConfig(splits=8, chunk=64, block_n=64, stages=3, merge_chunks=64, merge_d=32)
# fixed 64-position chunks, a merge of up to 64 chunks per step in 32-column programs (Hq * D / 32 of them)
FIXED64_CONFIG = AttnConfig(chunk=64, block_n=64, merge_chunks=64, merge_d=32)

# Explicit candidates timed by scripts/attn_sweep.py (and checked against float64 by the tests);
# the ones that break the rule for a head dim are skipped there.
CANDIDATE_CONFIGS = (
    LEGACY_CONFIG,
    FIXED64_CONFIG,
    AttnConfig(chunk=128, block_n=128, merge_chunks=16),
    AttnConfig(chunk=128, block_n=128, merge_chunks=64, merge_d=32),
    AttnConfig(chunk=128, block_n=128, merge_chunks=64, merge_d=16),
    AttnConfig(chunk=128, block_n=128, warps=8, merge_chunks=64, merge_d=32),
    AttnConfig(chunk=128, block_n=128, merge_chunks=64, merge_warps=8, merge_d=64),
    AttnConfig(chunk=256, block_n=64, stages=2, merge_chunks=64, merge_d=32),
    AttnConfig(chunk=256, block_n=64, stages=3, merge_chunks=64, merge_d=32),
    AttnConfig(chunk=512, block_n=64, stages=3, merge_chunks=64, merge_d=32),
    AttnConfig(chunk=512, block_n=64, warps=8, stages=3, merge_chunks=64, merge_d=32),
    AttnConfig(chunk=256, block_n=32, stages=3, merge_chunks=64, merge_d=32),
    AttnConfig(chunk=256, block_n=128, warps=8, stages=2, merge_chunks=64, merge_d=32),
    # adaptive chunks (splits): one captured launch whose chunk length follows the run-time length
    AttnConfig(splits=4, chunk=64, block_n=64, stages=3, merge_chunks=64, merge_d=32),
    SPLIT8_CONFIG,
    AttnConfig(splits=16, chunk=64, block_n=64, stages=3, merge_chunks=64, merge_d=32),
    AttnConfig(splits=8, chunk=128, block_n=128, warps=8, stages=2, merge_chunks=64, merge_d=32),
)
SPLITS_MIN_KV_HEADS = 32  # the default uses SPLIT8_CONFIG from this many kv heads up (else FIXED64_CONFIG)


# ----------------------------------------------------------------------------- static resource rule
# A model of what Triton 3.6 allocates for sm_90 (calibrated by compiling the kernels ahead of time with the
# launch specialization: 16-aligned pointers and strides):
#  - a single tile stages K (block_n x BLOCK_D fp16) through shared memory for tl.dot: ~1.25x K
#    (64x128: 20 KiB, 128x128: 36 KiB, 128x256: 72 KiB), plus q and p once BLOCK_G grows past 16
#    (G = 64: 128x128 80 KiB, 64x256 96 KiB);
#  - a pipelined loop (stages >= 2) adds stages - 1 buffers of K and V (64x128, 2 / 3 stages: 38 /
#    70 KiB; 64x256: 74 / 138 KiB);
#  - more than 128 tile elements of K per thread (128x256 with 4 warps) made ptxas spill.
# The limit is 227 KiB per block; the rule keeps the estimate under SMEM_BUDGET. (A 3-stage loop over 128x256
# tiles needs 268 KiB; a single 128x256 tile needs 72.)
SMEM_BUDGET = 192 * 1024
TILE_PER_THREAD = 128


def block_d(d: int) -> int:
    """The kernels' head-dim tile: D rounded up to a power of two, at least 16."""
    return max(16, 1 << max(0, (int(d) - 1).bit_length()))


def block_g(g: int) -> int:
    """The kernels' query-row tile: G rounded up to a power of two, at least 16 (tl.dot's smallest M)."""
    return max(16, 1 << max(0, (int(g) - 1).bit_length()))


def smem_estimate(block_n: int, d: int, stages: int = 1, loop: bool = False, g: int = 1) -> int:
    """The rule's model of the shared memory (bytes) of a kernel walking block_n x D tiles of K and V
    for g query heads (padded to BLOCK_G rows: q and p are staged for tl.dot too)."""
    bd, bg = block_d(d), block_g(g)
    k_tile = block_n * bd * 2
    est = k_tile * 5 // 4 + 2 * bg * bd * 2 + bg * block_n * 2 + 1024
    if loop and stages >= 2:
        est += (stages - 1) * 2 * k_tile
    return est


def config_fits(cfg: AttnConfig, d: int, g: int = 1) -> bool:
    """The static rule: cfg is well formed and stays inside shared memory / registers for head dim d."""
    def p2(x):
        return isinstance(x, int) and x >= 1 and x & (x - 1) == 0

    if not (p2(cfg.block_n) and 16 <= cfg.block_n <= 256 and p2(cfg.chunk) and cfg.chunk >= cfg.block_n):
        return False
    if not (cfg.warps in (2, 4, 8, 16) and cfg.merge_warps in (1, 2, 4, 8, 16) and 1 <= cfg.stages <= 4):
        return False
    if not (p2(cfg.merge_chunks) and cfg.merge_chunks <= 256
            and (cfg.merge_d == 0 or p2(cfg.merge_d) and cfg.merge_d >= 16)):
        return False
    if not (cfg.splits == 0 or p2(cfg.splits) and cfg.splits <= 64):
        return False
    if smem_estimate(cfg.block_n, d, cfg.stages, loops(cfg), g) > SMEM_BUDGET:
        return False
    return cfg.block_n * block_d(d) <= TILE_PER_THREAD * 32 * cfg.warps


# ----------------------------------------------------------------------------- choice
def named_config(name: str) -> AttnConfig:
    """The candidate config called `name` (AttnConfig.name), e.g. Options.attn_config."""
    by_name = {c.name: c for c in CANDIDATE_CONFIGS}
    if name not in by_name:
        raise ValueError(f"attn_config: unknown config {name!r}; candidates: {', '.join(by_name)}")
    return by_name[name]


@functools.lru_cache(maxsize=256)
def choose_config(d: int, g: int, t_max: int, hkv: int | None = None) -> AttnConfig:
    """The production config for head dim d, group size g, a cache of t_max positions and hkv kv heads (None:
    unknown). The rule: SPLIT8_CONFIG (8 programs per kv head whose chunk follows the length) with at least
    SPLITS_MIN_KV_HEADS kv heads (MHA 32x128, e.g. Llama-2-7B: faster at 4k, about even at short context); with
    fewer kv heads 8 splits are too few programs to fill the GPU, so fixed_chunk_config. NOTES-engine.md
    (session 6) has the measurements."""
    if hkv is not None and hkv >= SPLITS_MIN_KV_HEADS and config_fits(SPLIT8_CONFIG, d, g):
        return SPLIT8_CONFIG
    return fixed_chunk_config(d, g)


@functools.lru_cache(maxsize=256)
def fixed_chunk_config(d: int, g: int) -> AttnConfig:
    """FIXED64_CONFIG (the fastest or within 6% of the fastest candidate at every shape of the sweep), or
    LEGACY_CONFIG where it would break the static rule for (d, g)."""
    return FIXED64_CONFIG if config_fits(FIXED64_CONFIG, d, g) else LEGACY_CONFIG


def resolve_config(config: AttnConfig | str | None, d: int, g: int, t_max: int, hkv: int | None) -> AttnConfig:
    """The config of a launch: an AttnConfig as given, a name (named_config), or None / '' -> choose_config.
    A config that breaks the static rule for (d, g) raises ValueError naming `config`."""
    if isinstance(config, str):
        config = named_config(config) if config else None
    if config is None:
        return choose_config(d, g, t_max, hkv)
    if not isinstance(config, AttnConfig):
        raise ValueError(f"config: expected an AttnConfig, a config name or None, got {config!r}")
    if not config_fits(config, d, g):
        raise ValueError(f"config: {config.name} breaks the resource rule for D={d}, G={g} (config_fits)")
    return config
