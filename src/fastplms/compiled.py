"""The compiled inference path of `embed_dataset` (runtime module: imports torch and .attention).

A model whose base model has `embedding_core(input_ids, valid, compile)` gets a `CompiledEmbedding`:
masks are checked here, outside any compiled region, and the model compiles what it chooses through
`compile(fn)`: dynamic shapes, one compiled function per `fn` and model instance, kept for later calls.
ESM2 compiles the two halves of a layer around attention once and runs them for every layer, so the
compile takes seconds rather than the minutes a whole-model graph takes on a CPU (and whole-model
Inductor weight freezing was measured no faster here: docs/benchmarks.md). `embed_dataset` still uses
this path only for jobs of at least `COMPILE_MIN_RESIDUES` residues, or once it is compiled already.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable

import torch

from .attention import attend

# Break-even between compile time and the compiled path's higher throughput, measured on 2 CPU cores
# at ESM2-35M (docs/benchmarks.md): below it the eager path finishes first.
COMPILE_MIN_RESIDUES = 80_000
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
