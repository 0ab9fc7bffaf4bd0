"""The compiled inference path of `embed_dataset` (runtime module: imports torch and .attention).

A model whose base model has `embedding_core(input_ids, valid, compile)` gets a `CompiledEmbedding`:
masks are checked here, outside any compiled region, and the model compiles what it chooses through
`compile(fn)`: dynamic shapes, one compiled function per `fn` and model instance, kept for later calls.
ESM2 compiles the two halves of a layer around attention once and runs them for every layer, so the
compile takes seconds rather than the minutes a whole-model graph takes on a CPU (and whole-model
Inductor weight freezing was measured no faster here: docs/benchmarks.md). `embed_dataset` still uses
this path only where it pays back (`PathChoice`): the first batch of a job always runs eager, so the first
result never waits for a compile; the rest compiles only when the eager rate measured on that batch projects
at least `COMPILE_MIN_SECONDS` more, and a compiled path measured slower than eager is dropped.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable

import torch

from .attention import attend

# Break-even between compile time and the compiled path's higher throughput: eager seconds the rest of a job
# must be projected to take before compiling pays back. Measured on 2 CPU cores at ESM2-35M
# (docs/benchmarks.md): a compile takes 4 s (warm Inductor cache) to 9 s (cold) and saves about a tenth.
COMPILE_MIN_SECONDS = 300.0
# A compiled path measured this much slower than eager (seconds per unit of `batch_cost`) is dropped.
SLOWER_MARGIN = 0.03
# Compiled batches timed (the compiling call excluded) before the compiled and eager rates are compared.
COMPARE_AFTER = 2
COMPILED_BACKENDS = ("sdpa",)


def run_layers_packed(layers, plan, h, cos, sin, compile: Callable):
    """Encoder layers (`plm_base.AttentionLayer`) on the packed tokens `h` of `plan` (from
    `attention.attention_plan`): each layer's `attention_inputs` and `finish` compiled (once per layer
    class) around the attention facade, which runs uncompiled on the packed (tokens, heads, head_dim)
    tensors exactly as in the layer's own forward."""
    before, after = compile(type(layers[0]).attention_inputs), compile(type(layers[0]).finish)
    for layer in layers:
        q, k, v = before(layer, h, cos, sin)  # (tokens, heads, head_dim) each
        h = after(layer, h, attend(q, k, v, plan, scale=layer.attention_scale))
    return h


def weights_key(model: torch.nn.Module) -> tuple:
    """Changes whenever a parameter or buffer is replaced, moved or modified in place."""
    return tuple(
        (name, id(t), t._version, t.dtype, t.device) for name, t in (*model.named_parameters(), *model.named_buffers())
    )


class CompiledEmbedding:
    """`base.embedding_core` with compiled parts, for one model instance; call it like an embedding forward."""

    def __init__(self, base: torch.nn.Module) -> None:
        self.base = base
        self.key = weights_key(base)
        self.functions: dict[Callable, Callable] = {}
        self.calls = 0
        self.compile_seconds: float | None = None
        self.slower = False  # measured slower than the eager path (`PathChoice`)

    def compile(self, fn: Callable) -> Callable:
        compiled = self.functions.get(fn)
        if compiled is None:
            # A private code object: Dynamo caches (and counts recompilations) per code object, so models
            # compiled in the same process never evict each other or exhaust a shared recompile budget.
            fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
            compiled = self.functions[fn] = torch.compile(fresh, dynamic=True)
        return compiled

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if attention_mask.dtype != torch.bool:
            if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
                raise ValueError("attention_mask must contain only 0 and 1.")
            attention_mask = attention_mask.bool()
        if not bool(attention_mask.any(dim=-1).all()):
            raise ValueError("every batch row needs at least one valid token.")
        started = time.perf_counter()
        out = self.base.embedding_core(input_ids, attention_mask, self.compile)
        if self.calls == 0:
            self.compile_seconds = time.perf_counter() - started
        self.calls += 1
        return out


def batch_cost(attention_mask: torch.Tensor, hidden: int) -> float:
    """Work of one batch in units that make batches of any widths comparable: per row of T tokens,
    T * (6 * hidden + T), proportional to an encoder layer's matmul FLOPs (24 hidden^2 per token for the
    projections and MLP, 4 hidden per token pair for attention)."""
    lengths = attention_mask.sum(-1).double()
    return float((lengths * (6 * hidden + lengths)).sum())


class PathChoice:
    """Which path runs each batch of one `embed_dataset` job, from `compile` (True / False / None) and the
    job's size; with None it measures both paths and decides.

    The first batch runs eager (the first result never waits for a compile). The rest compiles if the eager
    rate of that batch projects at least `COMPILE_MIN_SECONDS` for the remaining residues, or right away when
    the model has compiled before. A compiled path measured slower than the eager one by `SLOWER_MARGIN` (over
    `COMPARE_AFTER` batches after the compile) runs no more batches, in this job or later ones of the same
    model (until its weights change). Compiling on one processor does not make it faster on every one.
    """

    def __init__(self, runner: CompiledEmbedding | None, compile: bool | None, residues: int | None, hidden: int):
        self.runner, self.forced, self.residues, self.hidden = runner, compile, residues, hidden
        self.compile: bool | None = None  # decided after the first eager batch
        self.eager = [0.0, 0.0, 0]  # seconds, cost, residues
        self.compiled = [0.0, 0.0, 0]  # seconds, cost, batches (the compiling call excluded)

    @property
    def measuring(self) -> bool:
        return self.runner is not None and self.forced is None and not self.runner.slower

    def next(self) -> str:
        runner = self.runner
        if runner is None or self.forced is False or (self.forced is None and runner.slower):
            return "eager"
        if self.forced or runner.calls > 0:
            return "compiled"
        if self.compile is None:
            seconds, _, residues = self.eager
            if not residues:
                return "eager"
            remaining = None if self.residues is None else self.residues - residues
            self.compile = remaining is not None and remaining * seconds / residues >= COMPILE_MIN_SECONDS
        return "compiled" if self.compile else "eager"

    def record(self, path: str, seconds: float, attention_mask: torch.Tensor, compiled_now: bool) -> None:
        """One batch's wall time on `path`; `compiled_now`: this call compiled (its time is not a rate)."""
        cost = batch_cost(attention_mask, self.hidden)
        if path == "eager":
            self.eager[0] += seconds
            self.eager[1] += cost
            self.eager[2] += int(attention_mask.sum())  # tokens: residues plus a few specials per row
            return
        if compiled_now or not self.measuring or not self.eager[1]:
            return
        self.compiled[0] += seconds
        self.compiled[1] += cost
        self.compiled[2] += 1
        if self.compiled[2] >= COMPARE_AFTER:
            eager_rate, compiled_rate = self.eager[0] / self.eager[1], self.compiled[0] / self.compiled[1]
            self.runner.slower = compiled_rate > eager_rate * (1 + SLOWER_MARGIN)
