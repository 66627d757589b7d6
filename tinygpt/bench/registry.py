"""Rows of `python -m tinygpt bench`, registered by the day that owns them.

Each row group is a function `rows(ctx: BenchContext) -> list[Comparison]` in a module of this
package, decorated with `@register(name, day=N)`; ROW_MODULES lists those modules, in the order
their rows are printed within a day. `python -m tinygpt bench --only NAME` runs one group.

    @register("batched_decode", day=13)
    def batched_decode(ctx: BenchContext) -> list[Comparison]:
        model = ctx.build(bandwidth_model_config())
        ...
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tinygpt.bench.harness import Comparison
from tinygpt.bench.models import build_model
from tinygpt.bench.plan import BenchPlan, bench_plan
from tinygpt.model import ModelConfig, TinyGPT

# Modules whose import registers row groups; a day adds its module here.
ROW_MODULES: tuple[str, ...] = (
    "tinygpt.bench.decode",         # days 11-12: KV cache, HF generate, bandwidth, roofline
    "tinygpt.bench.captured",       # day 11 on a GPU: the decode loop in CUDA graphs
    "tinygpt.bench.smollm2",        # day 12: SmolLM2's shape at the CPU's bandwidth roof
    "tinygpt.bench.batching",       # day 13: batched decode
    "tinygpt.bench.speculative",    # day 14: speculative greedy decoding
    "tinygpt.bench.quant",          # day 15: int8 / int4 decode steps, torchao side by side
    "tinygpt.bench.engine",         # day 17: the serving engine, HF continuous batching, goodput
    "tinygpt.bench.serving",        # day 17: the server on SmolLM2 vs generate() and llama.cpp
    "tinygpt.bench.parallel",       # day 18: tensor-parallel decode against one process
    "tinygpt.bench.structured",     # day 19: structured outputs: validity, compile, mask cost
    "tinygpt.bench.moe",            # day 20: MoE dispatch, decode bandwidth, bytes, EP, routing
    "tinygpt.bench.longctx",        # day 21: MLA decode at 4,096 tokens, a window's flat KV
)


@dataclass
class BenchContext:
    """What a row group gets: the plan (plan.name is "quick" or "full"), the device, the seed,
    the torch threads and a log function for progress lines (stderr in the CLI).
    skipped: {group or row name: why it did not run}, filled by skip(); the report lists it.
    missed: the names in skipped that are targets this run should have judged."""

    plan: BenchPlan = field(default_factory=bench_plan)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seed: int = 0
    threads: int = 1
    log: Callable[[str], None] = print
    skipped: dict[str, str] = field(default_factory=dict)
    missed: set[str] = field(default_factory=set)

    def skip(self, name: str, reason: str, *, targeted: bool = False) -> list[Comparison]:
        """Record that the group or row `name` did not run, and why; log it; return [] (a
        group can `return ctx.skip(...)`). targeted: a course target that should run here
        (an optional package is missing): a skip is not a pass, so run_bench's
        all_targets_met is then False. Leave it False for rows meant for another device."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"reason must be a non-empty str, got {reason!r}")
        self.skipped[name] = reason
        if targeted:
            self.missed.add(name)
        self.log(f"{name}: skipped: {reason}")
        return []

    @property
    def quick(self) -> bool:
        """True for the quick plan: a row group should then finish in well under a minute."""
        return self.plan.name == "quick"

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def build(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> TinyGPT:
        """A model of shape `cfg` with seeded random weights on this context's device."""
        return build_model(cfg, self.device, self.seed, dtype)


@dataclass(frozen=True)
class RowGroup:
    name: str
    day: int
    run: Callable[[BenchContext], list[Comparison]]

    @property
    def description(self) -> str:
        doc = (self.run.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else self.name


_GROUPS: dict[str, RowGroup] = {}


def register(name: str, *, day: int) -> Callable:
    """Decorator: add `fn(ctx) -> list[Comparison]` as the row group `name` of course day
    `day` (rows print ordered by day, then by registration)."""
    if not name or not name.replace("_", "").isalnum():
        raise ValueError(f"name must be a non-empty identifier, got {name!r}")
    if isinstance(day, bool) or not isinstance(day, int) or not 1 <= day <= 99:
        raise ValueError(f"day must be an int in [1, 99], got {day!r}")

    def wrap(fn: Callable[[BenchContext], list[Comparison]]):
        known = _GROUPS.get(name)
        if known is not None and known.run.__qualname__ != fn.__qualname__:
            raise ValueError(f"a bench row group named {name!r} is already registered "
                             f"(by {known.run.__module__})")
        _GROUPS[name] = RowGroup(name, day, fn)
        return fn

    return wrap


REQUESTS = "requests"       # the name --only uses for the streamed-request metrics (run.py's)


def row_groups(only: list[str] | None = None) -> list[RowGroup]:
    """Every registered group (importing ROW_MODULES first), by day; with `only`, just those
    names (an unknown name is an error that lists the known ones)."""
    for module in ROW_MODULES:
        importlib.import_module(module)
    groups = sorted(_GROUPS.values(), key=lambda g: g.day)     # stable: registration order
    if only is None:
        return groups
    known = [g.name for g in groups]
    unknown = [n for n in only if n not in known]
    if unknown:
        raise ValueError(f"unknown bench row group(s) {unknown}; choose from "
                         f"{[REQUESTS, *known]}")
    return [g for g in groups if g.name in only]
