"""Tests of the bfloat16 tiled products of tinygpt.cpu_kernels, both paths on one machine.

The library is compiled on first use with -march=native, so the CPU's flags choose the path:
with avx512_bf16 the products run on VDPBF16PS with x rounded to bfloat16 ("avx512_bf16 dot
products"), elsewhere the bfloat16 weights are widened to float32 and multiply float32 x
("widened to float32"). Oracles, each the float64 product of exactly what the path multiplies
(tests/float64.py::check_product: as close to it as F.linear's float32 product, plus one float32
step of the sum of |x| |w|):

    dot        x.bfloat16() . W.bfloat16(): a kernel that kept x in float32 is off by x's
               rounding (about 2^-9 of each term), hundreds of times the tolerance
    widened    x . W.bfloat16(), from a second build of the same source with -mno-avx512bf16,
               so a machine that has the instruction checks the other path too; its rows'
               sums side by side give the bits of its row-by-row loop (use_portable)

and on both: the rounding of x is torch's (to nearest, ties to even, seen through one-hot
weights), a row's output does not depend on the rows multiplied with it (the engine's batched
steps equal batch-1 generate()), and the path named matches the CPU's flags.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.float64 import check_product
from tinygpt import cpu_kernels as ck

pytestmark = pytest.mark.skipif(ck.available() is not None, reason=str(ck.available()))

DOT, WIDENED = ck.BF16_PATHS[1], ck.BF16_PATHS[0]
SHAPES = [(16, 1, 1), (48, 33, 3), (1024, 320, 2), (960, 576, 4), (4096, 64, 1), (64, 7, 2),
          (32, 13, 1), (32, 20, 4)]        # K = 1 .. 576: every count of pairs left over


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (None where there is none)."""
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        return None
    for line in info.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


@pytest.fixture(scope="module")
def widened():
    """The kernels built a second time without avx512_bf16: the widened path on any x86-64."""
    library = ck.build("-mno-avx512bf16")
    lib = library.load()
    if lib is None:
        pytest.skip(library.available())
    return library


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request, widened):
    before = ck.set_threads(request.param)
    widened.set_threads(request.param)
    yield request.param
    ck.set_threads(before)
    widened.set_threads(before)


def data(n: int, k: int, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=generator) * 0.05,
            torch.randn(rows, k, generator=generator))


def product(lib, tiled: ck.TiledLinear, x: torch.Tensor) -> torch.Tensor:
    """tiled's product of x on the library `lib` (either build)."""
    y = torch.empty(x.shape[0], tiled.n_pad)
    assert lib.tg_gemv(ck.FORMATS["bf16"], tiled.tiled.data_ptr(), x.contiguous().data_ptr(),
                       y.data_ptr(), x.shape[0], tiled.n_pad, tiled.k) == 0
    return y[:, :tiled.n]


def native_targets_this_cpu(flags) -> bool:
    """Whether the compiler's -march=native target should equal /proc/cpuinfo's flags: not when
    CC names another compiler (a wrapper that builds for another CPU kind, as a check of the
    AVX2 kind on an AVX-512 machine does), nor without /proc/cpuinfo."""
    return flags is not None and "CC" not in os.environ


def test_the_path_follows_the_cpu_flags(widened):
    from tinygpt import native

    assert ck.bf16_path(widened.load()) == WIDENED
    targeted = "__AVX512BF16__" in native.target_macros(ck.FLAGS)
    assert ck.bf16_path() == (DOT if targeted else WIDENED), \
        "the default build's bfloat16 path does not match what its compiler targets"
    flags = cpu_flags()
    if native_targets_this_cpu(flags):
        assert targeted == ("avx512_bf16" in flags), \
            "-march=native's target does not match this CPU's avx512_bf16 flag"


@pytest.mark.parametrize("n,k,rows", SHAPES)
def test_dot_products_multiply_bfloat16_x_by_bfloat16_weights(threads, n, k, rows):
    if ck.bf16_path() != DOT:
        pytest.skip(f"this build's bfloat16 path is {ck.bf16_path()!r} (the CPU has no "
                    f"avx512_bf16); the widened build's test covers it")
    w, x = data(n, k, rows)
    tiled = ck.TiledLinear(w, fmt="bf16")
    (got,) = tiled(x)
    rounded = x.bfloat16().float()
    assert torch.equal(ck.kernel_input(x, "bf16"), rounded)
    check_product("the avx512_bf16 dot products", got, rounded, w.bfloat16().float())


@pytest.mark.parametrize("n,k,rows", SHAPES)
def test_widened_products_multiply_float32_x(threads, widened, n, k, rows):
    w, x = data(n, k, rows, seed=1)
    tiled = ck.TiledLinear(w, fmt="bf16")
    lib = widened.load()
    got = product(lib, tiled, x)
    check_product("the widened bfloat16 products", got, x, w.bfloat16().float())
    before = lib.tg_use_portable(1)          # every row's sums side by side, or row by row:
    try:                                     # the same sums in the same order
        assert torch.equal(product(lib, tiled, x), got)
    finally:
        lib.tg_use_portable(before)


def test_x_is_rounded_to_nearest_even_only_by_the_dot_path(widened):
    """One-hot weights (1.0 is exact in bfloat16) pass each x through a product alone: the dot
    path returns x.bfloat16() (ties to even: 1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6), the
    widened path x itself."""
    k = 40
    tie = 2.0 ** -8
    values = [1 + tie, 1 + 3 * tie, 1 + tie * 1.01, -(1 + tie), 3.14159, -2.71828e-3, 1e-20,
              6.5e4, 0.0, -1 - 3 * tie]
    x = torch.tensor(values + [0.1 * i + 0.0123 for i in range(k - len(values))])[None]
    tiled = ck.TiledLinear(torch.eye(k), fmt="bf16")
    assert torch.equal(product(widened.load(), tiled, x), x)
    (got,) = tiled(x)
    want = x.bfloat16().float() if ck.bf16_path() == DOT else x
    assert torch.equal(got, want)
    if ck.bf16_path() == DOT:
        assert got[0, 0] == 1 and got[0, 1] == 1 + 4 * tie and got[0, 2] == 1 + 2 * tie


def test_a_row_comes_out_the_same_whatever_rows_come_with_it(widened):
    w, x = data(960, 576, 4, seed=2)
    tiled = ck.TiledLinear(w, fmt="bf16")
    for lib in (ck.load(), widened.load()):
        alone = [product(lib, tiled, x[r:r + 1]) for r in range(4)]
        assert torch.equal(product(lib, tiled, x), torch.cat(alone)), ck.bf16_path(lib)


def test_the_bfloat16_tiles_hold_column_pairs():
    w = torch.arange(20 * 5, dtype=torch.float32).reshape(20, 5)
    tiles = ck.tile(w, torch.bfloat16)
    assert tiles.shape == (2, 3, 16, 2) and tiles.dtype == torch.bfloat16
    assert tiles[0, 1, 3].tolist() == [w[3, 2].item(), w[3, 3].item()]
    assert tiles[1, 2, 3].tolist() == [w[19, 4].item(), 0.0]       # the padding column
    assert tiles[1, 0, 4].tolist() == [0.0, 0.0]                   # a padding row


def test_gcc_builds_keep_every_multiply_add_fused(tmp_path, monkeypatch):
    """GCC's tuning for AMD's Zen cores splits some multiply-add chains in two (other bits
    than the fused ones the kernels promise on every width): a GCC build gets GCC_FLAGS, a
    clang build (which defines __GNUC__ too, and knows no such parameter) does not."""
    import subprocess

    from tinygpt import native

    monkeypatch.setenv("TINYGPT_CACHE", str(tmp_path))
    commands = []

    def run(command, **kwargs):
        commands.append(command)
        if "-o" in command:
            Path(command[command.index("-o") + 1]).write_bytes(b"")
        return subprocess.CompletedProcess(command, 0, "a compiler", "")

    monkeypatch.setattr(native.subprocess, "run", run)
    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    for macros, fused in (("#define __GNUC__ 12", True),
                          ("#define __GNUC__ 4\n#define __clang__ 1", False)):
        monkeypatch.setattr(native, "target_macros", lambda flags, m=macros: m)
        native.compile_source(source)
        assert all(flag in commands[-1] for flag in native.GCC_FLAGS) == fused


def test_the_cache_keeps_one_build_per_cpu_kind(tmp_path, monkeypatch):
    """The path is chosen when the library compiles (-march=native); a cache that another CPU
    kind filled (a home directory shared by an AMD and an Intel machine) must not hand this one
    its build: the key holds what the compiler targets."""
    from tinygpt import native

    flags = cpu_flags()
    if native_targets_this_cpu(flags):
        assert ("__AVX512BF16__" in native.target_macros(ck.FLAGS)) == ("avx512_bf16" in flags)
    assert "__AVX512BF16__" not in native.target_macros(ck.FLAGS + ("-mno-avx512bf16",))
    monkeypatch.setenv("TINYGPT_CACHE", str(tmp_path))
    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    here = native.compile_source(source)
    monkeypatch.setattr(native, "target_macros", lambda flags: "#define __ANOTHER_CPU__ 1")
    there = native.compile_source(source)
    assert here.is_file() and there.is_file() and here != there
