"""The tensor-parallel model: a TinyGPT whose layers are the parallel ones.

    TensorParallelGPT   one rank's shard of a TinyGPT: the same module tree and forward; the KV
                        cache, generate() and the day-17 engine run on it unchanged, one copy
                        per rank
    shard_model         a TensorParallelGPT from an ordinary TinyGPT (any loader's output)
    tp_check            the model from a source run on local ranks: logits, greedy tokens
                        through generate() and through the engine, for comparison with one
                        process
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    distributed_argmax,
)
from tinygpt.parallel.ranks import _group_rank, run_ranks
from tinygpt.parallel.sharding import plan_heads, shard_state_dict, vocab_range
from tinygpt.parallel.source import load_source
from tinygpt.positions import scaled_rope_cos_sin


class TensorParallelGPT(TinyGPT):
    """One rank's shard of a TinyGPT: the same module tree and forward, parallel layers inside.

    It is a TinyGPT (the KV cache, generate(), the engine and its runner accept it); every
    rank must run the same calls in the same order, since each layer's all-reduce waits for
    all ranks. cfg is the FULL model's config; `plan` gives this rank's heads. The KV cache
    made for it (KVCache.for_model, PagedKVCache.for_model) holds `cache_kv_heads` heads.
    Build it with shard_model.
    """

    fused_decode = False            # DecodeStep's fused/packed fast path skips the all-reduces

    def __init__(self, cfg: ModelConfig, shard: Mapping[str, torch.Tensor], rank: int,
                 world_size: int, group=None) -> None:
        check_tensor_parallel(cfg)
        # the module tree of a miniature TinyGPT (same layers, heads and norm eps; no full-size
        # weight is ever allocated), whose every weight is then replaced by this rank's shard;
        # head_dim=None: heads 2 wide, not cfg's (the real head_dim is set on each layer below)
        skeleton = dataclasses.replace(cfg, vocab_size=1, d_model=2 * cfg.n_heads, d_ff=1,
                                       max_seq_len=1, tie_embeddings=False, head_dim=None)
        super().__init__(skeleton, seed=None)
        self.cfg = cfg
        self.rank, self.world_size, self.group = rank, world_size, group
        self.plan = plan_heads(cfg, rank, world_size)
        start, _ = vocab_range(cfg.vocab_size, rank, world_size)
        self.tok_embeddings = VocabParallelEmbedding(shard["tok_embeddings.weight"], start, group)
        head = shard["tok_embeddings.weight"] if cfg.tie_embeddings else shard["output.weight"]
        self.output = VocabParallelHead(head, cfg.vocab_size, group)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        for i, block in enumerate(self.layers):
            p = f"layers.{i}."
            attn, mlp = block.attention, block.feed_forward
            attn.n_heads, attn.n_kv_heads = self.plan.n_heads, self.plan.n_kv_heads
            attn.head_dim = cfg.head_dim
            for name in ("wq", "wk", "wv"):
                setattr(attn, name, ColumnParallelLinear(shard[f"{p}attention.{name}.weight"]))
            attn.wo = RowParallelLinear(shard[f"{p}attention.wo.weight"], group)
            mlp.w1 = ColumnParallelLinear(shard[f"{p}feed_forward.w1.weight"])
            mlp.w3 = ColumnParallelLinear(shard[f"{p}feed_forward.w3.weight"])
            mlp.w2 = RowParallelLinear(shard[f"{p}feed_forward.w2.weight"], group)
            for norm in ("attention_norm", "ffn_norm"):
                getattr(block, norm).weight = nn.Parameter(shard[f"{p}{norm}.weight"],
                                                           requires_grad=False)
            if cfg.qk_norm:             # per head, so every rank applies it to its own heads
                for norm in ("q_norm", "k_norm"):
                    getattr(attn, norm).weight = nn.Parameter(
                        shard[f"{p}attention.{norm}.weight"], requires_grad=False)
        self.norm.weight = nn.Parameter(shard["norm.weight"], requires_grad=False)
        cos, sin = scaled_rope_cos_sin(cfg.head_dim, cfg.max_seq_len, cfg.rope_base,
                                       cfg.rope_scaling)            # day 21's scalings
        self.rope_cos, self.rope_sin = cos.to(self.norm.weight), sin.to(self.norm.weight)
        self.eval()

    @property
    def cache_kv_heads(self) -> int:
        """KV heads this rank's attention writes to its cache (its own, or 1 replica)."""
        return self.plan.n_kv_heads


def check_tensor_parallel(cfg: ModelConfig) -> None:
    """A ValueError for a model tensor parallelism does not split: a mixture-of-experts one
    (its experts are stacked (E, d_expert, D) tensors, not one SwiGLU to cut by d_ff; expert
    parallelism, tinygpt.parallel.experts, splits them by expert instead), a latent-attention
    one, and (not implemented here) sliding windows and dynamic RoPE. q/k norm is fine: it
    normalizes each head, and a rank holds whole heads."""
    if cfg.is_moe:
        raise ValueError(f"tensor parallelism splits dense SwiGLU layers by d_ff; "
                         f"{cfg.fast_path_refusal()}: split its experts with expert "
                         f"parallelism (tinygpt.parallel.experts) instead")
    if cfg.attention == "mla":                            # day 21
        raise ValueError(f"tensor parallelism splits wq, wk, wv and wo by heads; "
                         f"{cfg.fast_path_refusal()}")
    if cfg.sliding_window or cfg.rope_type == "dynamic":  # day 21
        what = (f"sliding-window attention (sliding_window={cfg.sliding_window})"
                if cfg.sliding_window else "'dynamic' (NTK) RoPE scaling")
        raise ValueError(f"tensor parallelism is not implemented for {what}: its shards are "
                         f"built and checked against the one-process model for full causal "
                         f"attention with fixed RoPE tables only")


def shard_model(model: TinyGPT, rank: int | None = None, world_size: int | None = None,
                group=None) -> TensorParallelGPT:
    """This rank's TensorParallelGPT from an ordinary TinyGPT (the shipped checkpoint, a
    Hugging Face or GGUF load: anything that returns a TinyGPT). rank and world_size default
    to the process group's; inside a group, a given one that is not the group's is a
    ValueError. The shard copies only its slices; drop `model` afterwards to free
    the full weights."""
    if not isinstance(model, TinyGPT):
        raise TypeError(f"model must be a TinyGPT, got {type(model).__name__}")
    check_tensor_parallel(model.cfg)
    rank, world_size = _group_rank(rank, world_size, group)
    with torch.no_grad():
        shard = shard_state_dict(model.state_dict(), model.cfg, rank, world_size)
    device = next(model.parameters()).device
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())   # NCCL: this rank's GPU
    return TensorParallelGPT(model.cfg, shard, rank, world_size, group).to(device)


# --------------------------------------------------------------------------------------------
# checked on local ranks against one process



def _hidden(model: TinyGPT, prompt: list[int]) -> torch.Tensor:
    """The residual stream after the last block (before the final norm): (T, D)."""
    ids = torch.tensor([prompt], device=model.rope_cos.device)
    cos, sin = model.rope_cos[:len(prompt)], model.rope_sin[:len(prompt)]
    x = model.tok_embeddings(ids)
    for layer in model.layers:
        x = layer(x, cos, sin)
    return x[0]


def _tp_check_rank(rank: int, world_size: int, source, prompts: list[list[int]],
                   max_new_tokens: int) -> dict:
    """A rank of tp_check; every rank returns the same keys for its own shard: logits,
    greedy tokens through generate() and through the engine, kv_heads (its cache's), plan,
    argmax_agree (distributed_argmax of the last positions equals argmax of its logits) and
    ranks_agree (every rank's tokens and last logits' sums equal, gathered from all ranks)."""
    from tinygpt.engine import Engine
    from tinygpt.generate import generate
    from tinygpt.sampling import SamplingParams

    shard = shard_model(load_source(source), rank, world_size)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    with torch.inference_mode():
        device = shard.norm.weight.device
        logits = [shard(torch.tensor([p], device=device))[0].cpu() for p in prompts]
        tokens = [generate(shard, p, params).token_ids for p in prompts]
        engine = Engine(shard, max_running=len(prompts))
        engine_tokens = [r.token_ids for r in engine.generate(prompts, params)]
        last = torch.stack([lg[-1] for lg in logits])                         # (N, V)
        hidden = torch.stack([shard.norm(_hidden(shard, p))[-1] for p in prompts]).to(device)
        start, _ = vocab_range(shard.cfg.vocab_size, rank, world_size)
        greedy = distributed_argmax(shard.output.local_logits(hidden), start,
                                    shard.cfg.vocab_size).cpu()
    out = dict(logits=logits, tokens=tokens, engine_tokens=engine_tokens,
               kv_heads=shard.cache_kv_heads, plan=shard.plan,
               argmax_agree=torch.equal(greedy, last.argmax(-1)))
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (tokens, engine_tokens,
                                      [lg[-1].sum().item() for lg in logits]))
    out["ranks_agree"] = all(e == everyone[0] for e in everyone)
    return out


def tp_check(source, world_size: int, prompts: list[list[int]], max_new_tokens: int = 8,
             timeout_s: float = 120.0) -> dict:
    """Run the model from `source` (see load_source) tensor-parallel over `world_size` local
    ranks. Returns rank 0's dict: logits (per prompt (T, V)), tokens (greedy generate()),
    engine_tokens (greedy through the day-17 engine), kv_heads (the KV heads rank 0's cache
    holds: its own, or 1 replica), plan (rank 0's HeadPlan), argmax_agree (the vocabulary-
    parallel distributed_argmax of the last positions equals argmax of the gathered logits)
    and ranks_agree (every rank saw the same tokens and last-position logit sums)."""
    return run_ranks(_tp_check_rank, world_size, source, prompts, max_new_tokens,
                     timeout_s=timeout_s)[0]
