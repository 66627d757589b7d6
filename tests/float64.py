"""Float64 references shared by the tests of the float32 fast paths (see
tinygpt.testing.check_float32_error for the rule they feed)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as nnf

from tinygpt.model import TinyGPT
from tinygpt.testing import check_float32_error

EPS = torch.finfo(torch.float32).eps


def float64_twin(model: TinyGPT) -> TinyGPT:
    """The same model in float64 (a copy: the caller's stays float32), the truth the float32
    paths are measured against."""
    return copy.deepcopy(model).double()


def check_product(what: str, got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """`got` = x @ w.T as close to the float64 product as F.linear's float32 one: 4x its
    distance plus one float32 step of the largest sum of |x| |w| (a product of one column
    rounds once in both).

    Measured on AMD EPYC with AVX-512 2026-11-27, also with torch, MKL and oneDNN held to other code
    paths and the C kernels built for Haswell (AVX2, 256-bit, no VNNI), x86-64-v3 and Ice Lake: the
    float32 tiles (cpu_kernels, cpu_gemm) up to 1.3e-7 from float64, F.linear up to 9.5e-8
    (outputs up to 0.27; the largest of a few hundred errors up to 2.4x apart); the Q8_0 / Q4_1
    kernels up to 4.7e-6, F.linear up to 1.0e-5 (outputs up to 29). The fixed tolerances this
    replaced (1e-5 + 1e-5 relative, 1e-6 * k) were far above both. Another CPU's kernels (or
    ours built for another vector width) sum in another order; a wrong tile, block scale, lost
    column or a row of another sequence is off by the products' own size."""
    x64, w64 = x.double(), w.double()
    floor = EPS * nnf.linear(x64.abs(), w64.abs()).max().item()
    check_float32_error(what, got, nnf.linear(x, w), nnf.linear(x64, w64), factor=4, floor=floor)
