"""tinygpt: a small but real LLM inference package, written day by day in the tinygpt course.

One module per concept, named after the course day that finishes it:

    numerics    day 01  softmax, log-softmax, temperature, cross-entropy, perplexity
    tokenizer   day 02  byte-level BPE, special tokens, chat template, tiktoken bridge
    positions   day 03  embeddings, sinusoidal encoding, RoPE (day 21: its scalings)
    attention   day 04  causal mask, scaled dot-product and grouped-query attention
    model       day 05  RMSNorm, SwiGLU, the Llama-style TinyGPT and its config
    corpus      day 06  the synthetic grammar corpus with exact next-word probabilities
    train       day 06  the training loop, checkpoints and load_pretrained()
    sampling    day 07  temperature, top-k/p, min-p, typical, penalties
    generate    day 08  the generate loop, stop conditions, streaming
    detokenize  day 08  a streamed reply's text kept current one token at a time (ReplyText)
    flops       day 09  parameter, FLOP and byte counts
    roofline    day 10  hardware table, roofline model, measured local roofline
    kv_cache    day 11  the static KV cache, prefill and cached decode, KV memory
    captured    day 11  the decode loop on a GPU: one CUDA graph per capacity bucket, replayed
    cpu_kernels day 11  the C decode products: tiled weights (fp32, bf16, Q8_0, Q4_1), every
                        product split over the cores
    bench       day 12  TTFT, TPOT, percentiles, goodput; the course's speed targets (a package)
    metrics     day 12  one request's TTFT, TPOT and inter-token latencies (bench uses them)
    batching    day 13  padded batches, batched KV cache, beam search, batching simulator
    speculative day 14  draft-then-verify decoding, prompt-lookup drafting, acceptance stats
    quant       day 15  int8 / int4 weight-only quantization, quantized linear, int8 KV cache
    flash       day 16  online softmax, tiled attention, memory-traffic counts
    paged       day 16  the paged KV cache: block pool, block tables, prefix sharing
    triton_attention    day 16  a Triton kernel for the tiled attention forward (GPU or
                        interpreter); in README.md and the tests, not in the notebook
    scheduler   day 17  the engine's step policy: decodes first, chunked prefill, admission,
                        preemption
    runner      day 17  one forward pass over every scheduled token on the paged cache
    engine      day 17  continuous batching (Engine, AsyncEngine) and the reference SerialEngine
    cpu_gemm    day 17  the engine's many-row products and paged attention in C, on the CPU
    server      day 17  python -m tinygpt serve: an OpenAI-compatible HTTP server (a package)
    parallel    day 18  tensor and pipeline parallelism on local ranks, the cost model (a package)
    constrained day 19  a regex subset as a DFA, the vocabulary walk, masks, forced tokens
    structured  day 19  structured outputs in production: llguidance grammars behind the sampler
    moe         day 20  mixture of experts: routers, dispatch, the MoE layer, what decode reads
    hf_models   day 20  Hugging Face Llama, Mistral, Qwen3-MoE and Mixtral weights as TinyGPT
                        (DeepSeek-V3 through hf_deepseek)
    mla         day 21  multi-head latent attention: the latent cache, naive and absorbed decode
    hf_deepseek day 21  Hugging Face DeepSeek-V3 weights (latent attention, its MoE) as TinyGPT
    hf_fields   day 20  Hugging Face config fields: transformers' defaults per family, type checks
    long_context day 21 KV bytes by layout, StreamingLLM's attention sinks, fp8 KV cache
    rolling     day 21  sliding windows' KV memory: the rolling cache, windowed cache bytes
    hf_rope     day 21  RoPE scalings (positions: linear, dynamic, YaRN, Llama 3.1) and windows
                        of Hugging Face configs (Llama rope_scaling, Mistral, Mixtral)
    device_sampling     the token choice of a captured GPU step: per-row knobs, no host sync
    native              the C kernels (csrc/*.c): compiled on first use, loaded, threads started
    gguf                GGUF files: metadata, our own dequantization, a Llama GGUF as TinyGPT
    gguf_tokenizer      the byte-level BPE tokenizer and chat template stored in a GGUF file
    hf_tokenizer        a Hugging Face folder's tokenizer behind the same interface
    loading             a name or path -> (model, tokenizer, info): tinygpt, smollm2, .gguf, folders
    chat                python -m tinygpt chat: a streaming terminal chat

    testing             the checks behind every notebook test cell
"""

__version__ = "0.1.0"


def _drop_foreign_notices() -> None:
    """Installed with the course's test dependencies, torchao is imported by transformers too,
    and on a machine without CUDA it logs a warning for each CUDA-only library it ships (with
    the full path of the virtual environment) and, through torch, a deprecation notice about an
    Enum it registers. Neither concerns anything a student does here, and both land in the
    notebooks' outputs; exactly those two messages are dropped, everything else these loggers
    say still shows."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (message.startswith("Failed to load ") and "torchao" in message
                    or "is an Enum subclass and is now natively supported" in message)

    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if keep not in logger.filters:
            logger.addFilter(keep)


_drop_foreign_notices()


def load_pretrained(*args, **kwargs):
    """Load the course's shipped checkpoint: returns (model, tokenizer). See tinygpt.train."""
    from tinygpt.train import load_pretrained as _load_pretrained

    return _load_pretrained(*args, **kwargs)


THREADS_PER_CORE = 4       # thread_count's bound: usable cores x this


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system reports one, else
    os.cpu_count())."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):      # macOS and Windows have no sched_getaffinity
        return os.cpu_count() or 1


def thread_count(value, option: str = "--threads") -> int:
    """A command line's thread count (`--threads`), checked before torch.set_num_threads sees
    it: returns `value` when it is an int from 1 to usable_cores() x THREADS_PER_CORE, else a
    ValueError naming `option` and that range. The bound: torch's thread pool runs no faster
    with more threads than cores, a few per core are still worth measuring (oversubscription),
    while every thread costs a stack and a huge count crashes the process (100,000 threads
    end in a segfault; past 2**63, torch raises an overflow)."""
    bound = usable_cores() * THREADS_PER_CORE
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
        raise ValueError(f"{option} must be an integer from 1 to {bound} ({THREADS_PER_CORE} "
                         f"per usable core, {usable_cores()} here), got {value!r}")
    return value


def usable_device(name: str):
    """pick_device(name), refused with a ValueError when this machine cannot run it (a
    command line's --device: cuda without CUDA, cuda:N without an N-th GPU, mps without
    Apple's MPS)."""
    import torch

    try:
        device = pick_device(name)
    except ValueError as err:
        raise ValueError(f"--device: {err}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available here (torch "
                         f"{torch.__version__}); the choices are cpu, cuda, mps")
    if device.type == "cuda" and device.index is not None \
            and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s), cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    if device.type == "cpu" and device.index not in (None, 0):
        raise ValueError(f"--device {name}: the CPU is one device here: cpu (or cpu:0)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {name}: Apple's MPS is not available here")
    return device


def pick_device(prefer: str | None = None):
    """Return a torch.device: `prefer` if given, else CUDA, then MPS, then CPU. `prefer` is
    'cpu', 'cuda' or 'mps', optionally with a device index 0 .. 127 ('cuda:1'); anything else
    is a ValueError, raised before any CUDA call (usable_device checks the machine has it)."""
    import re

    import torch

    if prefer is not None:
        allowed = ("cpu", "cuda", "mps")
        kind, colon, index = str(prefer).partition(":")
        if kind not in allowed or colon and not (re.fullmatch(r"0|[1-9][0-9]*", index)
                                                 and int(index) < 128):    # torch's int8 index
            raise ValueError(f"device must be one of {allowed}, optionally with a device index "
                             f"0 .. 127 as in 'cuda:1', got {prefer!r}")
        return torch.device(prefer)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")
