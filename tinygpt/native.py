"""The course's C kernels (tinygpt/csrc/*.c): compiled on first use, loaded, their threads started.

Two libraries use this: tinygpt.cpu_kernels (batch-1 decode products, one C call per step)
and tinygpt.cpu_gemm (the engine's many-row products and paged attention). Each is one C
source with its own pool of helper threads, started when the library loads.

    compile_source(source)   the shared object for a source: built once per source (and the
                             headers beside it, such as pool.h), compiler, flags and the CPU
                             they target, cached under $TINYGPT_CACHE (default
                             ~/.cache/tinygpt), written atomically so that two processes
                             building at once never load half a file
    target_macros(flags)     what the compiler defines for the CPU `flags` target (-march=native:
                             this machine's ISA, e.g. __AVX512BF16__), part of the cache key
    NativeLibrary            one source: load() (None when it cannot run here; available()
                             then says why), set_threads(n), and `lock`, which serializes calls
                             into the pool (it runs one job at a time); a forked child starts
                             its own pool (the parent's threads do not exist in the child)
    torch_single_thread()    a context in which torch's own operations run on one thread,
                             for the work around the pools' products (see its docstring)
    in_huge_pages(t)         a copy of t in memory backed by 2 MiB pages where Linux allows
                             (the kernels' tiled weights: see its docstring for why)

Why compile on first use rather than at install time: `pip install -e .` stays a pure-Python
install, and -march=native builds for the machine that runs the kernels: the kernels' choices
by instruction set (AVX-512 VNNI for the integer products, avx512_bf16 for the bfloat16 ones)
are made from the CPU's flags where the library runs. A cache shared by machines of different
CPU kinds (a home directory that moves between an AMD and an Intel machine) keeps one build
per kind: the key holds what -march=native means on each.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd", "-shared",
         "-fPIC", "-pthread")
# GCC's tuning for AMD's Zen cores (what -march=native picks on the EPYC kinds) turns some
# loops' chains of 128- and 256-bit multiply-adds into a multiply and an add, two roundings
# instead of one: on the AVX2 EPYC, and in the AVX2 build on the AVX-512 one, a product's
# one-row register block summed differently from its six-row block and from the 512-bit
# build (tests/test_cpu_gemm.py compares the builds bit for bit). The kernels promise the same
# sums everywhere, so GCC builds keep every multiply-add fused. (Clang fuses `a += b * c`
# without such a tuning and knows no such parameter.)
GCC_FLAGS = ("--param=avoid-fma-max-bits=0",)


def cache_dir() -> Path:
    return Path(os.environ.get("TINYGPT_CACHE", Path.home() / ".cache" / "tinygpt"))


def _compiler() -> str:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found (set CC, or install gcc)")
    return compiler


def target_macros(flags: tuple[str, ...] = FLAGS) -> str:
    """The macros the C compiler predefines for the target `flags` select (their -m options:
    with -march=native the instruction sets of this machine's CPU, such as __AVX512VNNI__ and
    __AVX512BF16__), one `#define` a line; "" when the compiler cannot say."""
    target = [f for f in flags if f.startswith("-m")]
    done = subprocess.run([_compiler(), *target, "-E", "-dM", "-x", "c", os.devnull],
                          capture_output=True, text=True, check=False)
    return "\n".join(sorted(done.stdout.splitlines())) if done.returncode == 0 else ""


def compile_source(source: Path, flags: tuple[str, ...] = FLAGS) -> Path:
    """The shared object built from `source` with `flags` (built if not cached yet).

    OSError when there is no C compiler or the build fails (with the compiler's last words)."""
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=False).stdout
    macros = target_macros(flags)
    if "#define __GNUC__ " in macros and "#define __clang__ " not in macros:
        flags = (*flags, *GCC_FLAGS)
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + version.encode()
                         + " ".join(flags).encode() + platform.machine().encode()
                         + macros.encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            done = subprocess.run([compiler, *flags, str(source), "-o", str(out)],
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise OSError(f"compiling {source.name} failed: {done.stderr.strip()[-500:]}")
            os.replace(out, target)       # atomic: a concurrent build never sees half a file
    return target


class NativeLibrary:
    """One C source with a thread pool: `start(n) -> running`, `stop()` and `after_fork()`
    are the names of its pool functions; `declare(lib)` sets the other functions' ctypes
    signatures; `what` names it in the reason it cannot run ("the CPU kernels"); `flags`
    are the compiler's."""

    def __init__(self, source: Path, what: str, declare: Callable[[ctypes.CDLL], None], *,
                 start: str, stop: str, after_fork: str, flags: tuple[str, ...] = FLAGS
                 ) -> None:
        self.source, self.what, self.declare, self.flags = source, what, declare, flags
        self.names = (start, stop, after_fork)
        self.lock = threading.Lock()        # one call into the pool at a time
        self._loaded = False
        self._lib: ctypes.CDLL | None = None
        self._reason: str | None = None

    def _build(self) -> ctypes.CDLL:
        lib = ctypes.CDLL(str(compile_source(self.source, self.flags)))
        self.declare(lib)
        start, stop, after_fork = (getattr(lib, name) for name in self.names)
        start.argtypes, start.restype = [ctypes.c_int], ctypes.c_int
        stop.restype = after_fork.restype = None
        start(max(1, torch.get_num_threads()))
        os.register_at_fork(after_in_child=lambda: self._after_fork(lib))
        return lib

    def _after_fork(self, lib: ctypes.CDLL) -> None:
        """In a forked child: the pool's threads stayed in the parent; start the child's own."""
        self.lock = threading.Lock()
        start, _, after_fork = (getattr(lib, name) for name in self.names)
        after_fork()
        start(max(1, torch.get_num_threads()))

    def load(self) -> ctypes.CDLL | None:
        """The library, compiled and started on first use; None when it cannot be (the reason
        is then available())."""
        with self.lock:
            if not self._loaded:
                self._loaded = True
                if platform.machine() not in ("x86_64", "AMD64"):
                    self._reason = (f"{self.what} are written for x86-64; this machine is "
                                    f"{platform.machine()}")
                else:
                    try:
                        self._lib = self._build()
                    except OSError as err:
                        self._reason = f"{self.what} could not be built: {err}"
            return self._lib

    def available(self) -> str | None:
        """None when the library can run on this machine, else the reason it cannot."""
        self.load()
        return self._reason

    def set_threads(self, threads: int) -> int:
        """Split every job over `threads` threads from now on (the default is
        torch.get_num_threads() when the library loads); returns the count now running."""
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        lib = self.load()
        if lib is None:
            raise RuntimeError(self._reason)
        start, stop, _ = (getattr(lib, name) for name in self.names)
        with self.lock:
            stop()
            return start(threads)


@contextlib.contextmanager
def torch_single_thread():
    """Run torch's own operations on one thread inside the block (restored after).

    The libraries here split each product over the cores with threads of their own. What torch
    still runs around them in a decode step (norms, the embedding, sampling) is small, and a
    two-thread torch operation then costs more than it saves: it wakes an OpenMP team whose
    worker keeps spinning after each operation on the core the pool's helper needs, and on a
    busy machine it waits for whichever of its threads the operating system left without a
    core.
    """
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


HUGE_PAGE = 2 << 20          # x86-64's transparent huge page: 2 MiB
_MMAP = None                 # libc's mmap, munmap and madvise, once declared


def _libc():
    global _MMAP
    if _MMAP is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _MMAP = libc
    return _MMAP


def huge_pages_enabled() -> bool:
    """Whether in_huge_pages copies: Linux, and TINYGPT_HUGE_PAGES is not "0"."""
    return sys.platform == "linux" and os.environ.get("TINYGPT_HUGE_PAGES", "1") != "0"


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor t (any strides) in its own anonymous mapping, aligned
    to 2 MiB and advised MADV_HUGEPAGE, so that Linux backs every whole 2 MiB of it with one
    page; t itself (made contiguous) where that cannot be done: not Linux,
    TINYGPT_HUGE_PAGES=0, under 2 MiB, or a mapping refused. The mapping is released when
    the last view of the copy is.

    Why: a decode step streams every weight once, and with 4 KiB pages the stream crosses a
    page every 4 KiB: a TLB miss each time, and the hardware prefetchers stop at each
    boundary. SmolLM2's 120 layer products (425 MB of float32 tiles) as a chain on the 2-core
    AMD EPYC with AVX-512, 2026-11-27, six interleaved rounds: 19.4-21.3 ms in 4 KiB pages,
    14.6-16.2 ms in huge pages (1.20-1.44x). Only whole 2 MiB extents inside the mapping get
    huge pages and the mapping ends at the data's last 4 KiB page, so no memory is spent beyond
    the data."""
    n = t.numel() * t.element_size()
    if not huge_pages_enabled() or n < HUGE_PAGE or t.device.type != "cpu":
        return t.contiguous()
    libc = _libc()
    size = -(-n // 4096) * 4096
    base = libc.mmap(None, size + HUGE_PAGE, 3, 0x22, -1, 0)    # PROT_READ|WRITE, PRIVATE|ANON
    if base is None or base == ctypes.c_void_p(-1).value:
        return t.contiguous()
    start = -(-base // HUGE_PAGE) * HUGE_PAGE
    if start > base:
        libc.munmap(base, start - base)
    if base + HUGE_PAGE > start:
        libc.munmap(start + size, base + HUGE_PAGE - start)
    libc.madvise(start, size, 14)            # MADV_HUGEPAGE; an error leaves 4 KiB pages
    memory = (ctypes.c_char * size).from_address(start)
    weakref.finalize(memory, libc.munmap, start, size)
    out = torch.frombuffer(memory, dtype=torch.uint8)[:n].view(t.dtype).view(t.shape)
    return out.copy_(t)
