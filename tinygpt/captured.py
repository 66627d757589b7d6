"""Day 11 on a GPU: the decode loop captured in CUDA graphs and replayed without a host sync.

On a GPU a batch-1 decode step of a ~1B model is a few hundred small kernels, and the CPU
launches each one (several microseconds apiece) while the GPU, done with the last, waits. A
CUDA graph records one step's kernels once; a replay launches all of them in one call. A step
can be replayed only if it is the same every time:

    fixed addresses   it reads and writes the same tensors on every replay: the token buffer
                      (B, 1), the position (1,), the static KV cache (tinygpt.kv_cache,
                      static=True: written with index_copy_ at the position tensor), the
                      output buffer (B, max_len)
    no host sync      nothing in it copies a value to the host (no .item(), no Python `if` on
                      a tensor): the position lives on the device and advances there
                      (pos += 1), the token is chosen there (tinygpt.device_sampling: per-row
                      knobs as tensors, the draw an exponential race) and written into the
                      token buffer that the next replay reads, and the model's range checks
                      stand aside while a stream captures (tinygpt.model.capturing)
    fixed shapes      it attends over a fixed number of cache slots, masked past the position:
                      one graph per capacity bucket (KVCache.narrowed: views of the first
                      `capacity` slots). Positions below 256 replay the 256-slot graph, below
                      512 the 512-slot one, and so on, so a short context does not read the
                      whole cache, and no new prompt length ever captures (or compiles) again

The loop (CapturedDecoder.generate): one eager forward of the prompt into the static cache, the
first token chosen from its logits, then n - 1 steps. The host counts the positions itself, so
it picks the bucket's graph without asking the device; tokens collect in a device buffer that
is copied back once, at the end. Stopping at an end-of-sequence token is the caller's cut of
that buffer (the steps after it are computed and thrown away: no step waits for the host).

capture=False (the only choice off CUDA) runs the same step eagerly: tests/test_captured.py
checks it against batch-1 generate() on the CPU and checks that the step asks the host
nothing; the `-m gpu` tests replay the graphs against it. compile=True hands the step to
torch.compile first (fused kernels; one compilation per capacity bucket, then captured;
the sampler stays eager, since dynamo does not take its torch.Generator).

Not captured (refusal says why): a mixture of experts (day 20), whose routing counts each
expert's tokens on the host, and "dynamic" RoPE (day 21), whose tables depend on the length.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from tinygpt.device_sampling import row_params, sample_rows
from tinygpt.kv_cache import KVCache, prefill
from tinygpt.model import TinyGPT
from tinygpt.sampling import SamplingParams

BUCKET = 256          # slots per capacity bucket: a graph attends over a multiple of this


def refusal(model: TinyGPT) -> str | None:
    """Why the decode step of `model` cannot be captured in a CUDA graph (None when it can)."""
    if not isinstance(model, TinyGPT):
        return f"model must be a TinyGPT, got {type(model).__name__}"
    cfg = model.cfg
    if cfg.moe_layers:
        return ("a mixture of experts routes each token to experts counted on the host (day "
                "20): its step cannot be captured")
    if cfg.rope_type == "dynamic":
        return ("dynamic RoPE recomputes its tables from the context length on the host (day "
                "21): its step cannot be captured")
    return None


class CapturedDecoder:
    """Greedy or sampled decoding of B equal-length prompts on a static cache, one captured
    CUDA graph per capacity bucket (see the module docstring).

    model: a TinyGPT. batch_size: prompts decoded together. max_len: cache slots (default the
    model's max_seq_len). bucket: slots per capacity bucket. capture: replay CUDA graphs
    (default: on CUDA; False runs the same step eagerly; True off CUDA is refused).
    compile: torch.compile the model's forward in the step before it is captured (or
    run); the sampler stays eager.

    generate(prompt, params, max_new_tokens, seed) -> (B, max_new_tokens) token ids on the
    CPU. `captures` counts the graphs recorded so far (one per bucket a run reached, however
    many prompts of whatever lengths).
    """

    def __init__(self, model: TinyGPT, batch_size: int = 1, max_len: int | None = None, *,
                 bucket: int = BUCKET, capture: bool | None = None,
                 compile: bool = False) -> None:
        if not isinstance(model, TinyGPT):
            raise TypeError(f"model must be a TinyGPT, got {type(model).__name__}")
        weight = model.tok_embeddings.weight
        self.device = weight.device
        if capture is None:
            capture = self.device.type == "cuda"
        for name, flag in (("capture", capture), ("compile", compile)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if capture and self.device.type != "cuda":
            raise ValueError(f"capture=True needs the model on a CUDA device (CUDA graphs); it "
                             f"is on {self.device}: use capture=False")
        why = refusal(model)
        if capture and why is not None:
            raise ValueError(f"{why}; capture=False runs it eagerly")
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
            raise ValueError(f"bucket must be a positive int, got {bucket!r}")
        self.model, self.capture, self.compile = model, capture, compile
        self.cache = KVCache.for_model(model, batch_size, max_len, static=True)
        self.batch_size, self.max_len = batch_size, self.cache.max_len
        self.buckets = tuple(range(bucket, self.max_len, bucket)) + (self.max_len,)
        self._views: dict[int, KVCache] = {}
        with torch.inference_mode(False):          # ordinary tensors, written in place
            long = dict(dtype=torch.long, device=self.device)
            self.token = torch.zeros(batch_size, 1, **long)      # the token the step feeds
            self.pos = torch.zeros(1, **long)                    # ... and its position
            self.count = torch.zeros(1, **long)                  # tokens in `out` so far
            self.out = torch.zeros(batch_size, self.max_len, **long)
            self.params = row_params([SamplingParams()] * batch_size, self.device)
        self.generator = torch.Generator(device=self.device)
        # compile=True: the model's forward only (dynamo does not take a torch.Generator, so
        # the sampler stays eager: its kernels are captured all the same)
        self._logits = torch.compile(self._forward, fullgraph=True, dynamic=False) if compile \
            else self._forward
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.captures = 0
        self.length = 0                 # positions in the cache (the host's own count)

    # -- the step ----------------------------------------------------------------------------

    def _forward(self, cache: KVCache) -> torch.Tensor:
        return self.model(self.token, input_pos=self.pos, kv_cache=cache)[:, -1].float()

    def _body(self, cache: KVCache) -> None:
        """One decode step on device buffers only: the token at `pos` through the model over
        `cache`'s slots, the next token chosen, written to `out` and fed back."""
        logits = self._logits(cache)
        chosen = sample_rows(logits, self.params, self.generator)                  # (B,)
        self.out.index_copy_(1, self.count, chosen[:, None])
        self.token.copy_(chosen[:, None])
        self.pos.add_(1)
        self.count.add_(1)

    def bucket_for(self, length: int) -> int:
        """The capacity whose graph feeds a token at position `length` (>= length + 1)."""
        return self.buckets[bisect.bisect_left(self.buckets, length + 1)]

    def _view(self, capacity: int) -> KVCache:
        if capacity not in self._views:
            self._views[capacity] = self.cache.narrowed(capacity)
        return self._views[capacity]

    def _graph(self, capacity: int) -> torch.cuda.CUDAGraph:
        """The bucket's graph, captured on first use. The warm-up runs (on a side stream, as
        capture wants: the allocator, cuBLAS and a compiled step set themselves up) change the
        buffers, so they are put back after each: every warm-up writes where the next real
        step will (the cache slot at `pos`, the entry of `out` at `count`), and the capture
        leaves everything as it was."""
        if capacity in self._graphs:
            return self._graphs[capacity]
        view = self._view(capacity)
        state = (self.token, self.pos, self.count)
        saved = [t.clone() for t in state]
        rng = self.generator.get_state()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):
                self._body(view)
                for buffer, value in zip(state, saved, strict=True):
                    buffer.copy_(value)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.generator.set_state(rng)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device):
            graph.register_generator_state(self.generator)   # fresh draws on every replay
            with torch.cuda.graph(graph, pool=self._pool), torch.inference_mode():
                self._body(view)
        self._graphs[capacity] = graph
        self.captures += 1
        return graph

    def capture_all(self) -> None:
        """Capture every bucket's graph now (a server does this when it starts), so that no
        request pays for a capture when its context first reaches a bucket."""
        if self.capture:
            for capacity in self.buckets:
                self._graph(capacity)

    def step(self) -> None:
        """Feed the current token at the current position (after start()): one decode step."""
        if self.length >= self.max_len:
            raise ValueError(f"the cache is full: max_len={self.max_len} positions")
        capacity = self.bucket_for(self.length)
        if self.capture:
            self._graph(capacity).replay()
        else:
            with torch.inference_mode():
                self._body(self._view(capacity))
        self.length += 1

    # -- a run -------------------------------------------------------------------------------

    def start(self, prompt: torch.Tensor, params: SamplingParams | Sequence[SamplingParams],
              seed: int | None = None) -> None:
        """Prefill `prompt` (B, T) into the cache, eagerly, and choose each row's first token
        (params: one SamplingParams for every row, or one per row; the device path's knobs:
        temperature, top_k, top_p, min_p). seed: the generator's seed (None: a random one)."""
        self._check_prompt(prompt, 1)
        rows = [params] * self.batch_size if isinstance(params, SamplingParams) else params
        if not isinstance(rows, Sequence) or len(rows) != self.batch_size:
            raise ValueError(f"params must be one SamplingParams or {self.batch_size} of them")
        self.params.copy_(row_params(list(rows), self.device))
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.cache.reset()
        logits = prefill(self.model, self.cache, prompt.to(self.device))
        with torch.inference_mode():
            chosen = sample_rows(logits, self.params, self.generator)
        self.length = self.cache.length
        self.token.copy_(chosen[:, None])
        self.pos.fill_(self.length)
        self.out[:, 0] = chosen
        self.count.fill_(1)

    def _check_prompt(self, prompt, new_tokens: int) -> None:
        if not isinstance(prompt, torch.Tensor) or prompt.ndim != 2 \
                or prompt.dtype != torch.long or prompt.shape[0] != self.batch_size:
            raise ValueError(f"prompt must be a long tensor (batch_size={self.batch_size}, T), "
                             f"got {getattr(prompt, 'dtype', type(prompt).__name__)} "
                             f"{tuple(getattr(prompt, 'shape', ()))}")
        if prompt.shape[1] < 1 or prompt.shape[1] + new_tokens - 1 > self.max_len:
            raise ValueError(f"prompt ({prompt.shape[1]} tokens) + new tokens ({new_tokens}) - "
                             f"1 positions must be in [1, max_len={self.max_len}]")

    def generate(self, prompt: torch.Tensor, params: SamplingParams | Sequence[SamplingParams],
                 max_new_tokens: int, seed: int | None = None) -> torch.Tensor:
        """start(), then max_new_tokens - 1 steps: (B, max_new_tokens) token ids on the CPU
        (the loop itself never waits for the device; this copy does)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        self._check_prompt(prompt, max_new_tokens)
        self.start(prompt, params, seed)
        for _ in range(max_new_tokens - 1):
            self.step()
        return self.out[:, :max_new_tokens].cpu()
