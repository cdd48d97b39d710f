"""Compile the mixture-of-experts / latent-attention Triton kernels here, without a GPU, for sm_90 (the H200) at the
configurations the engine launches for DeepSeek-V2-Lite and Mixtral-8x7B: what the interpreter does not check
(layouts, tl.dot shapes, register and shared-memory budgets). Prints each kernel's registers, spills and shared
memory. Usage: TRITON_INTERPRET=0 PYTHONPATH=$PWD python3 scripts/triton_sm90_check.py
"""
from __future__ import annotations

import inspect
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from trapetum.kernels import expert_gemv as xg
from trapetum.kernels import expert_gemv_2x8 as x8
from trapetum.kernels import latent_attention as la
from trapetum.kernels import moe_route as mr


def compile_one(fn, types: dict, consts: dict, num_warps: int = 4):
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in names}
    k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    return k.metadata.shared, _resources(k.asm.get("cubin"))


def _resources(cubin: bytes | None) -> str:
    """cuobjdump's register / stack line for the cubin (where the CUDA toolkit is installed)."""
    import shutil
    import subprocess
    import tempfile
    import os
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    tool = shutil.which("cuobjdump") or (bundled if os.path.exists(bundled) else None)
    if cubin is None or tool is None:
        return "?"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(line.strip() for line in out.splitlines() if "REG" in line) or "?"


def main() -> int:
    if not isinstance(xg._gate_up_kernel, triton.runtime.JITFunction):
        print("set TRITON_INTERPRET=0")
        return 2
    p16, u8, i64, f32 = "*fp16", "*u8", "*i64", "*fp32"
    gu = {"x_ptr": p16, "idx_ptr": i64, "w_ptr": u8, "cb_ptr": p16, "y_ptr": p16}
    dn = {"x_ptr": p16, "idx_ptr": i64, "rw_ptr": f32, "w_ptr": u8, "cb_ptr": p16, "res_ptr": p16, "y_ptr": p16}
    gud, dnd = dict(gu, w_ptr=p16), dict(dn, w_ptr=p16)
    cases = [
        ("expert gate/up cb4 K=2048", xg._gate_up_kernel, gu,
         dict(DENSE=False, BITS=4, ACT=1, USE_GATHER=True, BLOCK_N=16, BLOCK_K=256)),
        ("expert gate/up cb4 no gather", xg._gate_up_kernel, gu,
         dict(DENSE=False, BITS=4, ACT=1, USE_GATHER=False, BLOCK_N=16, BLOCK_K=256)),
        ("expert gate/up fp16", xg._gate_up_kernel, gud,
         dict(DENSE=True, BITS=4, ACT=1, USE_GATHER=False, BLOCK_N=16, BLOCK_K=256)),
        ("expert down cb4 k=6", xg._down_kernel, dn,
         dict(KS=6, DENSE=False, BITS=4, HAS_RES=False, USE_GATHER=True, BLOCK_N=8, BLOCK_K=256)),
        ("expert down cb4 k=2", xg._down_kernel, dn,
         dict(KS=2, DENSE=False, BITS=4, HAS_RES=False, USE_GATHER=True, BLOCK_N=8, BLOCK_K=256)),
        ("expert down fp16 k=6", xg._down_kernel, dnd,
         dict(KS=6, DENSE=True, BITS=4, HAS_RES=False, USE_GATHER=False, BLOCK_N=16, BLOCK_K=256)),
        ("expert gate/up 2x8", x8._gate_up_2x8_kernel, {"x_ptr": p16, "idx_ptr": i64, "c_ptr": "*i8", "cb_ptr": p16,
                                                         "sc_ptr": p16, "y_ptr": p16},
         dict(ACT=1, BLOCK_N=16, BLOCK_G=32)),
        ("expert down 2x8 k=6", x8._down_2x8_kernel, {"x_ptr": p16, "idx_ptr": i64, "rw_ptr": f32, "c_ptr": "*i8",
                                                      "cb_ptr": p16, "sc_ptr": p16, "res_ptr": p16, "y_ptr": p16},
         dict(KS=6, HAS_RES=False, BLOCK_N=16, BLOCK_G=32)),
        ("route softmax E=64 k=6", mr._route_kernel, {"x_ptr": p16, "b_ptr": f32, "w_ptr": f32, "i_ptr": "*i32",
                                                       "scale": "fp32"},
         dict(K=6, SIGMOID=False, HAS_BIAS=False, NORM=False, EP=64, KP=8)),
        ("latent split R=512 P=64", la._split_kernel, {"ql_ptr": p16, "qr_ptr": p16, "cache_ptr": p16,
                                                        "start_ptr": "*i32", "part_ptr": f32, "ml_ptr": f32,
                                                        "scale": "fp32"},
         dict(CH=la.CHUNK, BLOCK_H=la.BH, BT=32, RP=512, PP=64), 8),
        ("latent merge R=512", la._merge_kernel, {"part_ptr": f32, "ml_ptr": f32, "start_ptr": "*i32", "o_ptr": p16},
         dict(CH=la.CHUNK, RP=512)),
        ("head gemv", la._head_gemv_kernel, {"x_ptr": p16, "w_ptr": p16, "y_ptr": p16}, dict(BLOCK_N=16, BLOCK_K=256)),
        ("rope + latent append", la._rope_append_kernel,
         {"q_ptr": p16, "c_ptr": p16, "kr_ptr": p16, "cos_ptr": f32, "sin_ptr": f32, "start_ptr": "*i32",
          "cache_ptr": p16, "qr_ptr": p16}, dict(INTERLEAVE=True, HP=32, RP=512)),
    ]
    bad = 0
    for case in cases:
        name, fn, types, consts = case[:4]
        try:
            shared, res = compile_one(fn, types, consts, *(case[4:] or ()))
            print(f"ok   {name}: shared {shared} B; {res}")
        except Exception as e:  # report every kernel, then fail
            bad += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
