"""Codebook dequantization (CUDA kernel, Triton under the interpreter or on CUDA, torch) equals the reference exactly."""
import pytest
import torch

from trapetum.kernels.codebook_gemv import dequantize as reference
from trapetum.kernels.dequant import dequantize
from trapetum.kernels.pack import pack_codes
from trapetum.settings import KernelOptions

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 1), (3, 7), (53, 97), (17, 257), (64, 1025), (5, 130), (33, 64), (9, 96), (70, 4096)]
OPTIONS = [KernelOptions(), KernelOptions(cuda=False)]  # on the GPU: the CUDA kernel (4-bit) and Triton


@pytest.mark.parametrize("kopts", OPTIONS, ids=["default", "kernels-off"])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n,k", SHAPES)
def test_dequant_matches_reference_bitwise(bits, n, k, kopts):
    g = torch.Generator().manual_seed(n * 1000 + k + bits)
    idx = torch.randint(0, 1 << bits, (n, k), generator=g)
    codes = pack_codes(idx, bits).to(DEV)
    cb = torch.randn(n, 1 << bits, generator=g).to(torch.float16).to(DEV)
    w = dequantize(codes, cb, bits, k, kopts=kopts)
    assert w.shape == (n, k) and w.dtype == torch.float16
    assert torch.equal(w.cpu(), reference(codes, cb, bits, k).cpu())


def test_torch_path_without_triton(monkeypatch):
    """A CPU without Triton (no interpreter): the torch reference path, same values."""
    import trapetum.kernels.dequant as dq
    monkeypatch.setattr(dq, "triton_ok", lambda device: False)
    codes = pack_codes(torch.randint(0, 16, (5, 33)), 4)
    cb = torch.randn(5, 16).half()
    assert torch.equal(dq.dequantize(codes, cb, 4, 33), reference(codes, cb, 4, 33))


def test_bad_shapes_raise():
    codes = torch.zeros(4, 8, dtype=torch.uint8)
    cb = torch.zeros(4, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="bits"):
        dequantize(codes, cb, 3, 16)
    with pytest.raises(ValueError, match="codes"):
        dequantize(codes, cb, 4, 40)
    with pytest.raises(ValueError, match="codebook"):
        dequantize(codes, cb[:, :8], 4, 16)
    with pytest.raises(ValueError, match="out"):
        dequantize(codes, cb, 4, 16, out=torch.empty(4, 15, dtype=torch.float16))
