"""Kernel variants kept for experiments, sweeps and comparisons; no production path imports them.

  attention_seq     the sequential decode-attention kernel (one program per kv head walking every chunk): the
                    split-KV kernel's predecessor, the sweep's reference row (scripts/attn_sweep.py)
  attention_inline  decode attention in one launch: the split kernel whose last program per kv head merges the
                    chunks (an atomic arrival counter) instead of the merge kernel; slower than the merge kernel on
                    the H200 except for MHA at short context (NOTES-engine.md, session 5)
  codebook_*        codebook GEMV variants (their module docstrings)

Each attention variant is tested against the float64 reference and the production path (tests/test_kernels_attention.py).
"""
