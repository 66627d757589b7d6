"""Day 06: a model worth sampling. Train TinyGPT on the grammar corpus and compare with the truth.

The pipeline, top to bottom:

1. Data. `tinygpt.corpus.generate_corpus` samples stories; `build_tokenizer` learns byte-level
   BPE on them; `encode_stories` lays the stories out as one long stream of token ids,
   ``<|endoftext|> story <|endoftext|> story ... <|endoftext|>``, so every story starts right after
   an end-of-text token; `get_batch` cuts random windows of `block_size` + 1 tokens out of it.
2. Training. `train` runs AdamW on the cross-entropy of the next token, with a learning rate that
   warms up linearly and then decays along a cosine (`lr_at`), and gradient-norm clipping. It
   returns the loss of every step (the loss curve). `evaluate` measures the loss on held-out text.
3. Checkpoints. `save_checkpoint` writes a directory with ``model.safetensors`` (float32 weights)
   and ``config.json`` (model config, tokenizer, training metadata, the weights' SHA-256);
   `load_checkpoint` checks every part and says what is wrong with a corrupt or mismatched one.
   `load_pretrained` loads the checkpoint shipped in ``tinygpt/data/``.
4. Against the truth. `model_word_log_probs` turns the model's next-*token* probabilities into
   next-*word* probabilities, `model_next_word_distribution` renormalises them over the words the
   grammar allows, and `kl_to_truth` averages KL(true || model) over prefixes.

From token probabilities to word probabilities
----------------------------------------------
A word (see `tinygpt.corpus`) after a prefix is written as text: " w" (a space, then the word)
in the middle of a story, "w" at its very start, "." glued to the previous word, and END as the
``<|endoftext|>`` token. Its tokens are the last tokens of ``encode(prefix + text)`` (the GPT-4
split pattern never merges across a space or between letters and ".", so ``encode(prefix)`` is
always a prefix of that). Then

    P_model(w | prefix) = prod_i P(token_i | prefix, token_<i) * P(word ends | prefix, w)

The last factor matters because " cat" could also be the start of " cats": the word is complete
only if the next token starts a new word, that is it begins with a space, is <|endoftext|>, or
(after a letter word) begins with ".". This counts only the canonical tokenization (the one
`encode` produces); other spellings of the same text (" c" + "at") get almost no probability in a
trained model and are ignored. For KL, the model's word probabilities are renormalised over the
words the grammar allows after the prefix (the support of the true distribution); the mass the
model put there before renormalising is reported separately.

Reproducing the shipped checkpoint
----------------------------------
    python -m tinygpt.train --out tinygpt/data --steps 2000 --seed 0 --threads 2

Training is deterministic on CPU for a given seed and thread count (every random draw comes from
a seeded generator: the corpus from random.Random, the weights and the batches from
torch.Generator). The same command on the same torch version and CPU type reproduces the weights
bit for bit (compare ``weights_sha256`` in config.json); other CPUs or thread counts may round
differently and land on a slightly different, equally good model.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from tinygpt import corpus
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.tokenizer import ENDOFTEXT, BPETokenizer, train_bpe

CHECKPOINT_FORMAT = "tinygpt-checkpoint"
CHECKPOINT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
PRETRAINED_DIR = Path(__file__).resolve().parent / "data"
PRETRAINED_MOE_DIR = PRETRAINED_DIR / "moe"      # day 20's mixture of experts (its README.md)

# --------------------------------------------------------------------------------------------
# 1. Data: tokenizer, token stream, batches.
# --------------------------------------------------------------------------------------------


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def build_tokenizer(stories: Sequence[str], max_vocab_size: int = 512) -> BPETokenizer:
    """Learn byte-level BPE on `stories` (a list of story strings), with the default specials.

    BPE stops early once every word of the text is a single token: the grammar has only about
    60 distinct words, so asking for 512 ids gives about 400 (256 bytes + the merges that build
    the words + 5 special tokens). That early stop is expected here and not warned about; read
    the real size from `tokenizer.vocab_size`.
    """
    if isinstance(stories, str) or not all(isinstance(s, str) for s in stories):
        raise TypeError("stories must be a list of strings (one story each)")
    _check_int("max_vocab_size", max_vocab_size, 262)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="train_bpe: the text has no pairs left")
        return train_bpe(ENDOFTEXT.join(stories), max_vocab_size)


def encode_stories(stories: Sequence[str], tokenizer: BPETokenizer) -> torch.Tensor:
    """One stream of ids, shape (N,): eot, story 1, eot, story 2, ..., eot (dtype torch.long).

    Every story is preceded by the end-of-text token, so the model learns how stories begin,
    and followed by it, so the model learns when they end.
    """
    eot = tokenizer.eot_id
    ids = [eot]
    for story in stories:
        ids.extend(tokenizer.encode(story))
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def get_batch(data: torch.Tensor, batch_size: int, block_size: int,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random training windows: inputs x and targets y = x shifted by one, both (B, T).

    data: (N,) token stream. Window b starts at a uniform offset s_b in [0, N - T - 1];
    x[b] = data[s_b : s_b + T] and y[b] = data[s_b + 1 : s_b + T + 1].
    """
    _check_int("batch_size", batch_size, 1)
    _check_int("block_size", block_size, 1)
    if data.ndim != 1 or len(data) < block_size + 1:
        raise ValueError(f"data must be a 1-D stream of at least block_size + 1 = "
                         f"{block_size + 1} ids, got shape {tuple(data.shape)}")
    starts = torch.randint(0, len(data) - block_size, (batch_size,), generator=generator)
    offsets = torch.arange(block_size + 1)
    windows = data[starts[:, None] + offsets]          # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]


# --------------------------------------------------------------------------------------------
# 2. Training and evaluation.
# --------------------------------------------------------------------------------------------


def lr_at(step: int, steps: int, max_lr: float, warmup_steps: int, min_lr: float) -> float:
    """Learning rate for `step` (0-based) of `steps`: linear warm-up, then cosine decay.

    Steps 0 .. warmup_steps - 1 rise linearly to max_lr ((step + 1) / warmup_steps * max_lr);
    the remaining steps follow half a cosine from max_lr down to min_lr at the last step; when
    only one step follows the warm-up it gets max_lr (progress divides by max(S - W - 1, 1)).
    """
    if not 0 <= step < steps:
        raise ValueError(f"step must be in [0, steps={steps}), got {step}")
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    decay_steps = steps - warmup_steps
    progress = (step - warmup_steps) / max(decay_steps - 1, 1)   # 0 -> 1
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (norm weights are not decayed)."""
    matrices = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": weight_decay},
              {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def language_model_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next token: x, y (B, T) -> scalar (nats per token)."""
    logits = model(x)                                  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def balance_loss(router_logits: torch.Tensor, experts: torch.Tensor, n_experts: int
                 ) -> torch.Tensor:
    """Day 20: the Switch Transformer's load-balancing loss of one MoE layer's forward.

    E * sum_e f_e P_e, where f_e is the share of the (token, slot) pairs routed to expert e and
    P_e the mean router probability of e (router_logits (N, E), experts (N, k)). f carries no
    gradient; P does, so the router learns to spread its probability where the load is low.
    It is 1.0 when routing is uniform; when every token picks the same k experts it grows to
    at most E / k (E for top-1), reached when the router puts all its probability on them.
    """
    share = torch.bincount(experts.reshape(-1), minlength=n_experts).float() / experts.numel()
    probs = torch.softmax(router_logits.float(), dim=-1).mean(dim=0)
    return n_experts * (share * probs).sum()


class _RouterLogits:
    """A forward hook on every softmax-routed MoE layer's gate: the router logits of the last
    forward, for `balance_loss` (the MoE layer itself keeps only the chosen experts)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from tinygpt.moe import MoE

        self.layers = [m for m in model.modules() if isinstance(m, MoE)]
        if not self.layers:
            raise ValueError("balance_weight > 0 needs a mixture-of-experts model (MoE layers, "
                             "day 20); this model has none: leave balance_weight at 0")
        if any(m.router != "softmax" for m in self.layers):
            raise ValueError("balance_weight > 0 needs softmax routers (DeepSeek-V3's sigmoid "
                             "router balances with its bias instead)")
        self.logits: dict[int, torch.Tensor] = {}
        self.hooks = [m.gate.register_forward_hook(self._keep(i))
                      for i, m in enumerate(self.layers)]

    def _keep(self, i: int):
        def hook(module, inputs, output):
            self.logits[i] = output
        return hook

    def loss(self) -> torch.Tensor:
        """The mean balance_loss over the MoE layers of the last forward."""
        return sum(balance_loss(self.logits[i], m.last_experts, m.n_experts)
                   for i, m in enumerate(self.layers)) / len(self.layers)

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def train(model: torch.nn.Module, data: torch.Tensor, steps: int, *, batch_size: int = 32,
          block_size: int = 128, lr: float = 3e-3, min_lr: float = 3e-4,
          warmup_steps: int = 50, weight_decay: float = 0.1, grad_clip: float = 1.0,
          seed: int = 0, progress: bool = True, balance_weight: float = 0.0) -> list[float]:
    """Train `model` in place for `steps` AdamW steps on random windows of `data` (N,).

    Each step: x, y = get_batch(...); loss = language_model_loss; backward; clip the gradient
    norm to `grad_clip`; set the learning rate from `lr_at`; optimizer step. The batches come
    from torch.Generator seeded with `seed`. progress=False hides the tqdm bar.
    balance_weight > 0 (a mixture of experts, day 20) adds that times the layers' mean
    `balance_loss` to the loss that is differentiated; the returned losses stay the language
    model's. Returns the training loss of every step, a list of `steps` floats (nats per token).
    """
    _check_int("steps", steps, 1)
    _check_int("warmup_steps", warmup_steps, 0)
    _check_int("seed", seed, 0)
    if not (0 < lr < math.inf and 0 <= min_lr <= lr):
        raise ValueError(f"need a finite lr > 0 and 0 <= min_lr <= lr, got lr={lr}, "
                         f"min_lr={min_lr}")
    if not 0 <= weight_decay < math.inf:
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay}")
    if not grad_clip > 0:
        raise ValueError(f"grad_clip must be > 0, got {grad_clip}")
    if not 0 <= balance_weight < math.inf:
        raise ValueError(f"balance_weight must be a finite number >= 0, got {balance_weight}")
    routers = _RouterLogits(model) if balance_weight > 0 else None
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    optimizer = make_optimizer(model, lr, weight_decay)
    model.train()
    losses: list[float] = []
    bar = tqdm(range(steps), disable=not progress, desc="training", leave=False)
    for step in bar:
        x, y = get_batch(data, batch_size, block_size, generator)
        loss = language_model_loss(model, x.to(device), y.to(device))
        objective = loss if routers is None else loss + balance_weight * routers.loss()
        optimizer.zero_grad(set_to_none=True)
        objective.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup_steps, min_lr)
        optimizer.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    if routers is not None:
        routers.remove()
    model.eval()
    return losses


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: torch.Tensor, block_size: int = 128,
             batch_size: int = 64) -> float:
    """Mean next-token cross-entropy (nats per token) over consecutive windows of `data` (N,).

    The stream is cut into floor((N - 1) / block_size) non-overlapping windows; every target
    token in them counts once. Deterministic; the model's train/eval mode is restored after.
    """
    _check_int("block_size", block_size, 1)
    _check_int("batch_size", batch_size, 1)
    n_windows = (len(data) - 1) // block_size
    if n_windows < 1:
        raise ValueError(f"data must hold at least block_size + 1 = {block_size + 1} ids")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    x_all = data[: n_windows * block_size].view(n_windows, block_size)
    y_all = data[1: n_windows * block_size + 1].view(n_windows, block_size)
    for i in range(0, n_windows, batch_size):
        x, y = x_all[i: i + batch_size].to(device), y_all[i: i + batch_size].to(device)
        total += language_model_loss(model, x, y).item() * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / count


# --------------------------------------------------------------------------------------------
# The whole recipe: corpus -> tokenizer -> model -> trained model.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a training run (the shipped checkpoint stores it)."""

    n_stories: int = 200_000       # training stories, sampled with corpus_seed
    corpus_seed: int = 0
    eval_stories: int = 2_000      # held-out stories for the evaluation loss, eval_seed
    eval_seed: int = 1
    max_vocab_size: int = 512
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 352
    max_seq_len: int = 1024        # longest prompt the model accepts (trained on block_size)
    block_size: int = 128
    batch_size: int = 32
    steps: int = 2000
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0                  # weight init and batch order
    n_experts: int = 0             # day 20: > 0 makes every layer a mixture of experts,
    top_k: int = 0                 # top_k of n_experts SwiGLUs of width d_expert per token,
    d_expert: int = 0              # softmax router, top k renormalized
    balance_weight: float = 0.0    # times the load-balancing loss (train's balance_weight)


# A run for a notebook: about a minute on the 2 idle cores of the AVX-512 EPYC (2026-11-21),
# held-out loss within ~0.03 nats of the floor and greedy text that is grammatical.
QUICK_CONFIG = TrainConfig(n_stories=20_000, steps=200, warmup_steps=20)


@dataclass
class TrainResult:
    """What `train_from_scratch` returns."""

    model: TinyGPT
    tokenizer: BPETokenizer
    losses: list[float]            # training loss per step
    eval_loss: float               # held-out loss after training, nats per token
    config: TrainConfig
    seconds: float                 # wall time of the whole run


def train_from_scratch(config: TrainConfig | None = None, progress: bool = True) -> TrainResult:
    """Generate the corpus, build the tokenizer and TinyGPT, train it; return the lot.

    A quick run for a notebook: train_from_scratch(QUICK_CONFIG). The defaults are the shipped
    checkpoint's recipe.
    """
    config = TrainConfig() if config is None else config
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    start = time.perf_counter()
    torch.manual_seed(config.seed)
    stories = corpus.generate_corpus(config.n_stories, config.corpus_seed).split("\n")
    held_out = corpus.generate_corpus(config.eval_stories, config.eval_seed).split("\n")
    tokenizer = build_tokenizer(stories, config.max_vocab_size)
    model_config = ModelConfig(
        vocab_size=tokenizer.vocab_size, d_model=config.d_model, n_layers=config.n_layers,
        n_heads=config.n_heads, n_kv_heads=config.n_kv_heads, d_ff=config.d_ff,
        max_seq_len=config.max_seq_len, n_experts=config.n_experts, top_k=config.top_k,
        d_expert=config.d_expert)
    model = TinyGPT(model_config, seed=config.seed)
    losses = train(model, encode_stories(stories, tokenizer), config.steps,
                   batch_size=config.batch_size, block_size=config.block_size, lr=config.lr,
                   min_lr=config.min_lr, warmup_steps=config.warmup_steps,
                   weight_decay=config.weight_decay, grad_clip=config.grad_clip,
                   seed=config.seed, progress=progress, balance_weight=config.balance_weight)
    eval_loss = evaluate(model, encode_stories(held_out, tokenizer), config.block_size)
    return TrainResult(model, tokenizer, losses, eval_loss, config, time.perf_counter() - start)


# --------------------------------------------------------------------------------------------
# 3. Checkpoints: model.safetensors + config.json in a directory.
# --------------------------------------------------------------------------------------------


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict with tied (shared) tensors listed once, under their first name."""
    seen: set[int] = set()
    weights = {}
    for name, tensor in model.state_dict().items():
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            weights[name] = tensor
    return weights


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_checkpoint(path: str | Path, model: TinyGPT, tokenizer: BPETokenizer,
                    extra: dict[str, Any] | None = None) -> Path:
    """Write `model` and `tokenizer` to the directory `path` (created if needed).

    model.safetensors: every weight in float32 (a tied matrix once). config.json: format and
    version, the ModelConfig, the tokenizer's to_dict(), the weights file's SHA-256 and `extra`
    (any JSON-serialisable dict, e.g. the training config and loss curve). Returns the path.
    """
    if not isinstance(model, TinyGPT):
        raise TypeError(f"model must be a TinyGPT, got {type(model).__name__}")
    if not isinstance(tokenizer, BPETokenizer):
        raise TypeError(f"tokenizer must be a BPETokenizer, got {type(tokenizer).__name__}")
    if tokenizer.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"tokenizer.vocab_size ({tokenizer.vocab_size}) != model vocab_size "
                         f"({model.cfg.vocab_size})")
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"extra must be JSON-serialisable: {exc}") from None
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous()
               for name, t in _weights(model).items()}
    # safetensors.torch.save gives the bytes of save_file; writing them ourselves keeps the
    # usual file permissions (save_file creates the file readable by its owner only).
    (path / WEIGHTS_FILE).write_bytes(save(tensors, metadata={"format": CHECKPOINT_FORMAT}))
    meta = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
            "weights_sha256": _sha256(path / WEIGHTS_FILE),
            "model_config": dataclasses.asdict(model.cfg),
            "tokenizer": tokenizer.to_dict(), "extra": extra}
    (path / CONFIG_FILE).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return path


def checkpoint_metadata(path: str | Path) -> dict[str, Any]:
    """Read and check a checkpoint's config.json; returns the parsed dict (with "extra")."""
    path = Path(path)
    config_path = path / CONFIG_FILE
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not config_path.is_file():
        raise FileNotFoundError(f"checkpoint {path} has no {CONFIG_FILE}")
    try:
        meta = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{config_path} is not a {CHECKPOINT_FORMAT} file (no "
                         f"'format': '{CHECKPOINT_FORMAT}' entry)")
    if meta.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{config_path} has version {meta.get('version')!r}; this tinygpt "
                         f"reads version {CHECKPOINT_VERSION}")
    missing = [k for k in ("weights_sha256", "model_config", "tokenizer", "extra") if k not in meta]
    if missing:
        raise ValueError(f"{config_path} is missing the field(s) {missing}")
    return meta


def _model_config_from(data: Any, where: Path) -> ModelConfig:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: model_config must be a JSON object, got {data!r}")
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown, missing = sorted(set(data) - names), sorted(
        f.name for f in dataclasses.fields(ModelConfig)
        if f.default is dataclasses.MISSING and f.name not in data)
    if unknown or missing:
        raise ValueError(f"{where}: model_config has unknown field(s) {unknown} and is missing "
                         f"field(s) {missing}")
    try:
        return ModelConfig(**data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: invalid model_config: {exc}") from None


def load_checkpoint(path: str | Path, device: torch.device | str | None = None
                    ) -> tuple[TinyGPT, BPETokenizer]:
    """Load a directory written by `save_checkpoint`; returns (model in eval mode, tokenizer).

    A missing directory, config.json or weights file is a FileNotFoundError. Then checks, each
    with a ValueError that says what is wrong: config.json parses and has the right format,
    version and fields; the ModelConfig and tokenizer are valid and agree on the vocabulary
    size; the weights file is a readable safetensors file whose SHA-256 matches config.json;
    it has exactly the model's tensor names, with the model's shapes, all finite.
    device: where to put the model (default CPU); one this machine lacks (cuda without CUDA,
    cpu:1) is a ValueError before anything is read.
    """
    if device is not None:
        import tinygpt

        try:
            device = tinygpt.usable_device(str(device))
        except ValueError as err:        # its messages name the command line's --device
            raise ValueError(str(err).replace("--device", "device", 1)) from None
    path = Path(path)
    meta = checkpoint_metadata(path)
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    cfg = _model_config_from(meta["model_config"], config_path)
    try:
        tokenizer = BPETokenizer.from_dict(meta["tokenizer"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{config_path}: invalid tokenizer: {exc}") from None
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ValueError(f"{config_path}: the tokenizer has {tokenizer.vocab_size} ids but the "
                         f"model_config says vocab_size={cfg.vocab_size}")
    if not weights_path.is_file():
        raise FileNotFoundError(f"checkpoint {path} has no {WEIGHTS_FILE}")
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"{weights_path} is not a readable safetensors file (truncated or "
                         f"corrupt?): {exc}") from None
    if _sha256(weights_path) != meta["weights_sha256"]:
        raise ValueError(f"{weights_path} does not match {CONFIG_FILE} (SHA-256 differs): the "
                         f"weights are corrupt or come from another checkpoint")

    model = TinyGPT(cfg, seed=None)
    expected = _weights(model)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{weights_path} does not match the model_config: missing tensors "
                         f"{missing}, unexpected tensors {unexpected}")
    wrong = [f"{name}: expected {tuple(t.shape)}, found {tuple(tensors[name].shape)}"
             for name, t in expected.items() if tensors[name].shape != t.shape]
    if wrong:
        raise ValueError(f"{weights_path} has tensors of the wrong shape: {'; '.join(wrong)}")
    bad = [name for name, t in tensors.items()
           if not t.is_floating_point() or not torch.isfinite(t).all()]
    if bad:
        raise ValueError(f"{weights_path} has non-float or non-finite values in {bad}")
    with torch.no_grad():
        for name, target in expected.items():
            target.copy_(tensors[name])
    return model.to(device or "cpu").eval(), tokenizer


def load_pretrained(device: torch.device | str | None = None) -> tuple[TinyGPT, BPETokenizer]:
    """The checkpoint shipped in tinygpt/data/: (model in eval mode, tokenizer). No download.

    device: default CPU; pass tinygpt.pick_device() to use CUDA or MPS when present.
    """
    return load_checkpoint(PRETRAINED_DIR, device)


def load_pretrained_moe(device: torch.device | str | None = None
                        ) -> tuple[TinyGPT, BPETokenizer]:
    """Day 20's mixture of experts shipped in tinygpt/data/moe/, trained on the same grammar
    with its own tokenizer (other ids; tinygpt/data/moe/README.md has its recipe)."""
    return load_checkpoint(PRETRAINED_MOE_DIR, device)


@torch.no_grad()
def experts_by_word_class(model: TinyGPT, tokenizer: BPETokenizer, stories: Sequence[str]
                          ) -> dict[int, dict[str, torch.Tensor]]:
    """Day 20: which experts each class of word goes to, layer by layer.

    Runs the stories (joined with the end-of-text token, as in training, in windows of
    max_seq_len) through the model and counts, for every MoE layer i and every word class of
    corpus.WORD_CLASS ("noun", "verb", "place", ...; "end" for the end-of-text token), how often
    a token of that class had each expert among its top k: {i: {class: counts (E,)}}. A token
    is the word with its leading space, so its class is the class of its word.
    """
    if not model.cfg.is_moe:
        raise ValueError("experts_by_word_class needs a mixture-of-experts model "
                         "(cfg.n_experts > 0)")
    ids = encode_stories(list(stories), tokenizer)
    classes = [corpus.WORD_CLASS.get(tokenizer.decode([int(i)]).strip(), "end") for i in ids]
    layers = [i for i in range(model.cfg.n_layers) if model.cfg.is_moe_layer(i)]
    counts = {i: defaultdict(lambda: torch.zeros(model.cfg.n_experts, dtype=torch.long))
              for i in layers}
    was_training = model.training
    model.eval()
    window = model.cfg.max_seq_len
    for start in range(0, len(ids), window):
        model(ids[start:start + window][None].to(next(model.parameters()).device))
        names = classes[start:start + window]
        for i in layers:
            chosen = model.layers[i].feed_forward.last_experts.cpu()        # (T, k)
            for name in set(names):
                rows = torch.tensor([n == name for n in names])
                counts[i][name] += torch.bincount(chosen[rows].reshape(-1),
                                                  minlength=model.cfg.n_experts)
    model.train(was_training)
    return {i: dict(sorted(c.items())) for i, c in counts.items()}


# --------------------------------------------------------------------------------------------
# 4. Against the truth: next-word probabilities and KL.
# --------------------------------------------------------------------------------------------


def _context_ids(tokenizer: BPETokenizer, prefix: str) -> list[int]:
    """<|endoftext|> followed by the prefix's canonical text: how training presents a story."""
    return [tokenizer.eot_id] + tokenizer.encode(corpus.join_words(corpus.split_words(prefix)))


def word_text(prefix: str, word: str) -> str:
    """The text that spells `word` right after `prefix`: "w" at the start of a story, "." as is,
    otherwise " w". (END has no text: it is the <|endoftext|> token.)"""
    if word == corpus.END:
        raise ValueError("END has no text; it is the <|endoftext|> token")
    if word == "." or not corpus.split_words(prefix):
        return word
    return " " + word


def word_boundary_mask(tokenizer: BPETokenizer, after_period: bool) -> torch.Tensor:
    """(V,) bool: the tokens that start a new word, so the word before them is complete.

    True for <|endoftext|> and every token whose first byte is a space; when the word before
    is made of letters (after_period=False), also for tokens starting with "." (the GPT-4
    split pattern never joins letters and "."; it does join "." with a following ".").
    """
    starts = {b" "} if after_period else {b" ", b"."}
    flags = [tokenizer.vocab.get(i, b"")[:1] in starts for i in range(tokenizer.vocab_size)]
    mask = torch.tensor(flags, dtype=torch.bool)
    mask[tokenizer.eot_id] = True
    return mask


@torch.no_grad()
def model_word_log_probs(model: TinyGPT, tokenizer: BPETokenizer, prefix: str,
                         words: Sequence[str]) -> dict[str, float]:
    """log P_model(word | prefix) for each word (natural log; not renormalised).

    A word's probability is the product of its tokens' probabilities times the probability
    that the word ends there (see the module docstring); END is P(<|endoftext|>). The context
    is <|endoftext|> + encode(prefix). All words go through the model in one padded batch.
    """
    if isinstance(words, str) or not words:
        raise ValueError(f"words must be a non-empty list of words, got {words!r}")
    for word in words:
        if word != corpus.END and corpus.split_words(word) != [word]:
            raise ValueError(f"each word must be END, '.' or a run of ASCII letters, got {word!r}")
    context = _context_ids(tokenizer, prefix)
    text = corpus.join_words(corpus.split_words(prefix))
    spelled: list[list[int]] = []
    for word in words:
        if word == corpus.END:
            spelled.append([tokenizer.eot_id])
            continue
        full = tokenizer.encode(text + word_text(prefix, word))
        if full[: len(context) - 1] != context[1:]:
            raise ValueError(f"the tokens of {prefix!r} change when {word!r} follows; the "
                             f"word probability is not defined for this tokenizer")
        spelled.append(full[len(context) - 1:])
    device = next(model.parameters()).device
    width = len(context) + max(len(s) for s in spelled)
    if width > model.cfg.max_seq_len:
        raise ValueError(f"prefix plus word is {width} tokens, over max_seq_len "
                         f"{model.cfg.max_seq_len}")
    batch = torch.full((len(spelled), width), tokenizer.eot_id, dtype=torch.long)
    for row, tokens in enumerate(spelled):
        batch[row, : len(context) + len(tokens)] = torch.tensor(context + tokens)
    log_probs = torch.log_softmax(model(batch.to(device)).float(), dim=-1).cpu()  # (W, T, V)
    ends = {False: word_boundary_mask(tokenizer, after_period=False),
            True: word_boundary_mask(tokenizer, after_period=True)}
    out = {}
    for row, (word, tokens) in enumerate(zip(words, spelled, strict=True)):
        positions = torch.arange(len(context) - 1, len(context) - 1 + len(tokens))
        total = log_probs[row, positions, torch.tensor(tokens)].sum()
        if word != corpus.END:  # the word must end here: the next token starts a new word
            boundary = ends[word == "."]
            total = total + torch.logsumexp(log_probs[row, positions[-1] + 1][boundary], dim=0)
        out[word] = float(total)
    return out


def model_next_word_distribution(model: TinyGPT, tokenizer: BPETokenizer,
                                 prefix: str) -> tuple[dict[str, float], float]:
    """The model's next-word distribution over the words the grammar allows after `prefix`.

    Returns (distribution, mass): `distribution` maps each word of
    corpus.next_word_distribution(prefix) to the model's probability renormalised over those
    words; `mass` is the model's total probability on them before renormalising (1.0 = the
    model never leaves the grammar here).
    """
    truth = corpus.next_word_distribution(prefix)
    log_probs = model_word_log_probs(model, tokenizer, prefix, list(truth))
    values = torch.tensor(list(log_probs.values()), dtype=torch.float64)
    log_mass = torch.logsumexp(values, dim=0)
    dist = {w: float(torch.exp(v - log_mass)) for w, v in zip(log_probs, values, strict=True)}
    return dist, float(torch.exp(log_mass))


def kl_divergence(p: dict[str, float], q: dict[str, float]) -> float:
    """KL(p || q) = sum_w p(w) ln(p(w) / q(w)) in nats, over the words with p(w) > 0.

    Every such word must have q(w) > 0 (else KL is infinite and this raises ValueError).
    """
    total = 0.0
    for word, pw in p.items():
        if pw <= 0:
            continue
        qw = q.get(word, 0.0)
        if qw <= 0:
            raise ValueError(f"q gives {word!r} probability {qw}, p gives {pw}: KL is infinite")
        total += pw * math.log(pw / qw)
    return total


def kl_to_truth(model: TinyGPT, tokenizer: BPETokenizer, prefixes: Sequence[str]) -> float:
    """Mean over `prefixes` of KL(true next-word distribution || model's), in nats.

    The model's distribution is renormalised over the words the grammar allows (see
    `model_next_word_distribution`). Held-out prefixes: corpus.sample_prefixes(n, seed).
    """
    if isinstance(prefixes, str) or len(prefixes) == 0:
        raise ValueError("prefixes must be a non-empty list of strings")
    total = 0.0
    for prefix in prefixes:
        model_dist, _ = model_next_word_distribution(model, tokenizer, prefix)
        total += kl_divergence(corpus.next_word_distribution(prefix), model_dist)
    return total / len(prefixes)


def loss_floor(tokenizer: BPETokenizer, n_stories: int = 500, seed: int = 2) -> float:
    """Monte-Carlo estimate of the corpus's entropy in nats per token: the best possible loss.

    Mean of -ln P(story) over sampled stories divided by their mean length in tokens (the
    story's tokens plus one <|endoftext|>). A model that sees the whole story so far cannot
    beat it on average; windows cut mid-story make the real floor a little higher.
    """
    _check_int("n_stories", n_stories, 1)
    stories = corpus.generate_corpus(n_stories, seed).split("\n")
    nats = sum(-math.log(corpus.story_probability(s)) for s in stories)
    tokens = sum(len(tokenizer.encode(s)) + 1 for s in stories)
    return nats / tokens


@torch.no_grad()
def sample_text(model: TinyGPT, tokenizer: BPETokenizer, prompt: str = "",
                max_new_tokens: int = 60, temperature: float = 0.0, seed: int = 0,
                stop_at_eot: bool = True) -> str:
    """Continue `prompt` (the start of a story) and return prompt + continuation.

    A plain loop without a KV cache (day 08 builds the real loop, day 11 adds the KV cache):
    feed <|endoftext|> + prompt, pick the next token (argmax at temperature 0, else sample from
    softmax(logits / T) with a generator seeded by `seed`), append, repeat. The context is
    cropped to the last max_seq_len tokens. Stops at <|endoftext|> if stop_at_eot, else
    writes it as a newline.
    """
    _check_int("max_new_tokens", max_new_tokens, 0)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    ids = [tokenizer.eot_id] + tokenizer.encode(prompt)
    pieces = [prompt]
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-model.cfg.max_seq_len:]], device=device)
        logits = model(context)[0, -1].float().cpu()
        if temperature == 0:
            next_id = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            next_id = int(torch.multinomial(probs, 1, generator=generator))
        ids.append(next_id)
        if next_id == tokenizer.eot_id:
            if stop_at_eot:
                break
            pieces.append("\n")
        else:
            pieces.append(tokenizer.decode([next_id]))
    return "".join(pieces)


# --------------------------------------------------------------------------------------------
# Command line: python -m tinygpt.train --out DIR [--steps N --seed S --threads T ...]
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Train from scratch, report loss and KL, save a checkpoint to --out."""
    parser = argparse.ArgumentParser(prog="python -m tinygpt.train", description=(
        "Train TinyGPT on the grammar corpus and save a checkpoint. The shipped one: "
        "--out tinygpt/data --steps 2000 --seed 0 --threads 2"))
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch CPU threads (results are reproducible per thread count)")
    parser.add_argument("--kl-prefixes", type=int, default=500,
                        help="held-out prefixes for the KL report")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    for field in dataclasses.fields(TrainConfig):
        parser.add_argument("--" + field.name.replace("_", "-"), type=type(field.default),
                            default=field.default, help=f"default {field.default}")
    args = parser.parse_args(argv)
    _check_int("threads", args.threads, 1)
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        _train_and_save(config, args)
    finally:
        torch.set_num_threads(threads_before)
    return 0


def _train_and_save(config: TrainConfig, args: argparse.Namespace) -> None:
    result = train_from_scratch(config, progress=not args.no_progress)
    model, tokenizer = result.model, result.tokenizer
    prefixes = corpus.sample_prefixes(args.kl_prefixes, seed=config.eval_seed + 1)
    kl = kl_to_truth(model, tokenizer, prefixes)
    cat_dist, cat_mass = model_next_word_distribution(model, tokenizer, "The cat sat on the")
    cat_kl = kl_divergence(corpus.next_word_distribution("The cat sat on the"), cat_dist)
    extra = {
        "train_config": dataclasses.asdict(config), "threads": args.threads,
        "torch_version": torch.__version__, "n_parameters": sum(
            t.numel() for t in _weights(model).values()),
        "eval_loss": result.eval_loss, "loss_floor": loss_floor(tokenizer),
        "kl_heldout": kl, "kl_prefixes": args.kl_prefixes,
        "kl_prefix_seed": config.eval_seed + 1, "kl_cat_sat_on_the": cat_kl,
        "cat_sat_on_the": cat_dist, "cat_sat_on_the_mass": cat_mass,
        "loss_history": [round(x, 5) for x in result.losses],
    }
    path = save_checkpoint(args.out, model, tokenizer, extra)
    meta = checkpoint_metadata(path)
    print(f"vocab_size {tokenizer.vocab_size}, {extra['n_parameters']:,} parameters, "
          f"{config.steps} steps in {result.seconds:.0f} s on {args.threads} thread(s)")
    print(f"final train loss {result.losses[-1]:.4f}, eval loss {result.eval_loss:.4f}, "
          f"loss floor {extra['loss_floor']:.4f} nats/token")
    print(f"KL(true || model) over {args.kl_prefixes} held-out prefixes: {kl:.5f} nats; "
          f"'The cat sat on the': {cat_kl:.5f} nats")
    print(f"  model {cat_dist} (mass {cat_mass:.4f})")
    print(f"greedy: {sample_text(model, tokenizer, '')!r}")
    print(f"saved {path}: weights sha256 {meta['weights_sha256']}")


if __name__ == "__main__":
    sys.exit(main())
