"""The grader seeds each sandboxed kernel's tinygpt.native cache (autograder/warm.py): the
copies must be found under the names the sandboxed kernel's own cache lookup computes (its
compiler is not necessarily the host's), so the kernel compiles nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from autograder.sandbox import SandboxPolicy, SandboxUnavailable, bwrap_path, sandbox_prefix
from autograder.warm import native_builds, seed_native_cache

LOOKUP = ("import time\n"
          "from tinygpt import cpu_gemm, cpu_kernels, native\n"
          "calls = []\n"
          "real = native.subprocess.run\n"
          "def run(cmd, *a, **k):\n"
          "    calls.append(cmd)\n"
          "    return real(cmd, *a, **k)\n"
          "native.subprocess.run = run\n"
          "found = [native.compile_source(lib.source, lib.flags).name\n"
          "         for lib in (cpu_kernels._library, cpu_gemm._library)]\n"
          "print(sorted(found), sum('-o' in c for c in calls))\n")


def test_a_sandboxed_kernel_finds_the_seeded_builds_and_compiles_nothing(tmp_path):
    try:
        bwrap_path()
    except SandboxUnavailable as err:
        pytest.skip(str(err))
    builds = native_builds()
    assert len(builds) == 2 and all(b.is_file() for b in builds)
    seed_native_cache(tmp_path)
    cache = tmp_path / ".cache" / "tinygpt"
    assert sorted(p.name for p in cache.iterdir()) == sorted(b.name for b in builds)
    done = subprocess.run(sandbox_prefix(SandboxPolicy(tmp_path)) + [sys.executable, "-c",
                                                                      LOOKUP],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"{sorted(b.name for b in builds)} 0"   # no build ran
