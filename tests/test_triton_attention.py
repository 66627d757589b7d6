"""The Triton attention forward (tinygpt/triton_attention.py) against
F.scaled_dot_product_attention and tinygpt.flash.tiled_attention.

Three groups:
  * bad input and availability: plain Python, no triton needed;
  * the kernel in Triton's CPU interpreter (TRITON_INTERPRET=1): runs wherever triton is
    installed, in one subprocess because the variable must be set before triton is imported;
    tiny shapes, fp32 (max abs error <= 1e-4) and fp16 (<= 2e-3). Not bf16: the interpreter
    multiplies bf16 tiles wrongly (NumPy has no bfloat16), so bf16 is checked on the GPU only;
  * the real compiler, ahead of time for sm_90 (PTX and cubin; no GPU needed, triton needed);
  * the compiled kernel on CUDA (marked gpu): fp32 (<= 1e-4, IEEE products, no TF32),
    fp16 (<= 3e-3) and bf16 (<= 2e-2), all against the fp32 reference on the same inputs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tinygpt.triton_attention as ta
from tinygpt.flash import tiled_attention
from tinygpt.triton_attention import triton_attention, triton_available

ROOT = Path(__file__).resolve().parents[1]
HAVE_TRITON = importlib.util.find_spec("triton") is not None
NO_TRITON = "triton is not installed; pip install triton to run the kernel in interpreter mode"


def reference(q, k, v, causal):
    """SDPA in fp32 with the bottom-right causal mask of tinygpt.attention and tinygpt.flash."""
    tq, tk = q.shape[-2], k.shape[-2]
    mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq) if causal else None
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)


# ---------------------------------------------------------------- bad input, availability

def qkv(tq=8, tk=8, d=16, dtype=torch.float32):
    return torch.randn(1, 2, tq, d, dtype=dtype), *(torch.randn(1, 2, tk, d, dtype=dtype)
                                                    for _ in range(2))


@pytest.mark.parametrize(("change", "message"), [
    (lambda q, k, v: (q[0], k, v), "q must be a 4-D tensor"),
    (lambda q, k, v: (q, k, v[..., :5, :]), "k and v must have the same shape"),
    (lambda q, k, v: (q, k[:, :1], v[:, :1]), "must agree in B, H and D"),
    (lambda q, k, v: (q, k[..., :8], v[..., :8]), "must agree in B, H and D"),
    (lambda q, k, v: (q[..., :8], k[..., :8], v[..., :8]), "head_dim"),
    (lambda q, k, v: (q.repeat(1, 1, 1, 3)[..., :24], k.repeat(1, 1, 1, 3)[..., :24],
                      v.repeat(1, 1, 1, 3)[..., :24]), "head_dim"),
    (lambda q, k, v: (q.repeat(1, 1, 1, 16), k.repeat(1, 1, 1, 16), v.repeat(1, 1, 1, 16)),
     "head_dim"),
    (lambda q, k, v: (q.double(), k.double(), v.double()), "q.dtype"),
    (lambda q, k, v: (q, k.long(), v), "k.dtype"),
    (lambda q, k, v: (q, k.half(), v), "share a dtype"),
    (lambda q, k, v: (q, k[..., :0, :], v[..., :0, :]), "at least one position"),
    (lambda q, k, v: (q, k[..., :5, :], v[..., :5, :]), "Tq <= Tk"),
    (lambda q, k, v: (q, k, v.tolist()), "v must be a 4-D tensor"),
])
def test_bad_tensors_are_refused_naming_the_argument(change, message):
    with pytest.raises(ValueError, match=message):
        triton_attention(*change(*qkv()))


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"block_q": 48}, "block_q"), ({"block_q": 8}, "block_q"), ({"block_q": True}, "block_q"),
    ({"block_k": 512}, "block_k"), ({"block_k": 16.0}, "block_k"),
])
def test_bad_block_sizes_are_refused(kwargs, name):
    with pytest.raises(ValueError, match=name):
        triton_attention(*qkv(), **kwargs)


def test_non_causal_attention_accepts_more_queries_than_keys(monkeypatch):
    monkeypatch.setattr(ta, "triton", None)        # stop after validation, before the kernel
    with pytest.raises(RuntimeError, match="triton is not installed"):
        triton_attention(*qkv(tq=9, tk=4), causal=False)


def test_availability_reasons(monkeypatch):
    monkeypatch.setattr(ta, "triton", None)
    assert triton_available() == (False, "triton is not installed")
    monkeypatch.setattr(ta, "triton", object())     # "installed"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert triton_available() == (False, "no CUDA device and TRITON_INTERPRET is not set")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ok, reason = triton_available()
    assert ok and "interpreter" in reason


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ok, reason = triton_available()
    with pytest.raises(RuntimeError, match="triton is not installed|no CUDA device|q is on cpu"):
        triton_attention(*qkv())
    if not ok:
        with pytest.raises(RuntimeError, match=re.escape(reason)):
            triton_attention(*qkv())


def test_the_module_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"      # makes `import triton` fail
            "import tinygpt.triton_attention as t; print(t.triton_available()[1])")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "triton is not installed"


# ---------------------------------------------------------------- Triton's CPU interpreter

# name -> (causal, Tq, Tk, head_dim, block_q, block_k, dtype, strided). 40, 37, 29, 33, 70, 9
# do not divide the blocks; Tq == Tk is prefill, Tq == 1 a decode step, 1 < Tq < Tk a chunk.
INTERPRETER_CASES = {
    "prefill-causal": (True, 40, 40, 16, 16, 16, "float32", False),
    "prefill-full": (False, 40, 40, 16, 16, 16, "float32", False),
    "prefill-causal-blocks-divide": (True, 32, 32, 32, 16, 16, "float32", False),
    "prefill-causal-unequal-blocks": (True, 45, 45, 16, 32, 16, "float32", False),
    "decode-causal": (True, 1, 37, 32, 64, 16, "float32", False),
    "decode-full": (False, 1, 37, 32, 64, 64, "float32", False),
    "chunk-causal": (True, 5, 29, 16, 16, 16, "float32", False),
    "chunk-causal-d64": (True, 33, 70, 64, 32, 16, "float32", False),
    "full-more-queries-than-keys": (False, 20, 9, 16, 16, 16, "float32", False),
    "chunk-causal-strided": (True, 19, 30, 16, 16, 16, "float32", True),
    "prefill-causal-fp16": (True, 24, 24, 32, 16, 16, "float16", False),
    "chunk-causal-fp16": (True, 7, 40, 32, 16, 16, "float16", False),
}
# float32: far above float32 rounding (measured on AMD EPYC with AVX-512 2026-11-27: the interpreted
# kernel 9e-8 to 4.2e-7 from the float64 SDPA, SDPA's float32 run 1.3e-7 to 5.0e-7, tiled 1.2e-7 to
# 6.2e-7, for outputs up to 3.6). float16: the output's rounding to float16, at most half a
# float16 step (9.8e-4 for these outputs, all under 4) plus float32 rounding; measured 6.1e-4,
# as torch's own float16 SDPA. A missing scale or mask is off by 0.1 or more.
INTERPRETER_TOL = {"float32": 1e-4, "float16": 2e-3}

# Runs in a subprocess with TRITON_INTERPRET=1; prints {name: result} as JSON.
INTERPRETER_SCRIPT = """
import json, sys
import torch
from tests.test_triton_attention import reference
from tinygpt.flash import tiled_attention
from tinygpt.triton_attention import triton_attention

results = {}
for name, (causal, tq, tk, d, bq, bk, dtype, strided) in json.loads(sys.argv[1]).items():
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    def make(t):
        if strided:               # (B, T, H, D) memory seen as (B, H, T, D): not contiguous
            return torch.randn(2, t, 3, d, generator=g).transpose(1, 2).to(getattr(torch, dtype))
        return torch.randn(2, 3, t, d, generator=g).to(getattr(torch, dtype))
    q, k, v = make(tq), make(tk), make(tk)
    out = triton_attention(q, k, v, causal=causal, block_q=bq, block_k=bk)
    tiled = tiled_attention(q.float(), k.float(), v.float(), causal=causal, block_q=bq,
                            block_k=bk)
    results[name] = {"dtype": str(out.dtype).removeprefix("torch."), "shape": list(out.shape),
                     "sdpa": (out.float() - reference(q, k, v, causal)).abs().max().item(),
                     "tiled": (out.float() - tiled).abs().max().item()}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreted():
    if not HAVE_TRITON:
        pytest.skip(NO_TRITON)
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", INTERPRETER_SCRIPT, json.dumps(INTERPRETER_CASES)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(INTERPRETER_CASES))
def test_the_interpreted_kernel_equals_sdpa_and_tiled_attention(interpreted, name):
    causal, tq, tk, d, _, _, dtype, _ = INTERPRETER_CASES[name]
    got = interpreted[name]
    assert got["dtype"] == dtype and got["shape"] == [2, 3, tq, d]
    assert got["sdpa"] <= INTERPRETER_TOL[dtype], got
    assert got["tiled"] <= INTERPRETER_TOL[dtype], got


# ---------------------------------------------------------------- compiled, on a GPU

@pytest.mark.parametrize(("dtype", "causal", "block_q", "block_k", "d", "decode"), [
    ("fp16", True, 64, 64, 64, False),
    ("bf16", False, 64, 32, 128, False),
    ("fp32", True, 16, 64, 64, True),      # Tq == 1: the launcher makes it a constant
])
def test_the_kernel_compiles_for_an_h100_without_one(dtype, causal, block_q, block_k, d, decode,
                                                    monkeypatch):
    """Triton compiles ahead of time for a named target with no GPU present: this runs the
    real code generator (not the interpreter) down to PTX and a cubin for sm_90."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed; pip install triton to compile the kernel")
    if ta._interpreting():
        pytest.skip("TRITON_INTERPRET is set: the kernel is an interpreted function here")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")    # Triton 3.9's default, said aloud
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = ta._attention_forward
    constants = {"CAUSAL": causal, "BLOCK_Q": block_q, "BLOCK_K": block_k, "HEAD_DIM": d,
                 "PRECISION": "ieee" if dtype == "fp32" else "tf32"}
    if decode:        # ints equal to 1 are specialised to constants by the launcher
        constants.update(TQ=1, sq_d=1, sk_d=1, sv_d=1, so_d=1)
    signature = {name: "constexpr" if name in constants else
                 f"*{dtype}" if name in ("Q", "K", "V", "O") else
                 "fp32" if name == "scale" else "i32" for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]
    if dtype != "fp32":                  # half-precision tiles go through the tensor cores
        assert "mma" in compiled.asm["ptx"]


GPU_TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(GPU_TOL), ids=str)
@pytest.mark.parametrize(("causal", "tq", "tk", "d", "block_q", "block_k"), [
    (True, 200, 200, 64, 64, 64),        # prefill, 200 not a multiple of 64
    (False, 200, 200, 64, 64, 32),
    (True, 1, 333, 128, 64, 64),         # decode
    (False, 1, 333, 64, 64, 128),
    (True, 50, 300, 128, 64, 64),        # chunked prefill on top of 250 cached keys
    (True, 256, 256, 16, 128, 64),
    (True, 1000, 1000, 64, 64, 64),
])
def test_the_compiled_kernel_on_cuda(dtype, causal, tq, tk, d, block_q, block_k):
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available: the compiled Triton kernel needs a GPU")
    if not HAVE_TRITON:
        pytest.skip("triton is not installed; pip install triton to compile the kernel")
    if ta._interpreting():
        pytest.skip("TRITON_INTERPRET is set: the kernel would be interpreted, not compiled")
    if dtype == torch.float32 and d == 128:       # 64 x 64 fp32 tiles need ~180 KB of SRAM
        block_q, block_k = 32, 32
    g = torch.Generator(device="cuda").manual_seed(tq + tk + d)
    q = torch.randn(2, 4, tq, d, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(2, 4, tk, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    out = triton_attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    assert out.dtype == dtype and out.shape == q.shape
    tol = GPU_TOL[dtype]
    want = reference(q, k, v, causal)
    torch.testing.assert_close(out.float(), want, rtol=0, atol=tol)
    if tq * tk <= 200 * 300:
        tiled = tiled_attention(q.float(), k.float(), v.float(), causal=causal)
        torch.testing.assert_close(out.float(), tiled, rtol=0, atol=tol)
