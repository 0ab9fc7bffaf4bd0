"""The compiled inference path of `embed_dataset` (runtime module: imports torch only).

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
import torch.nn.functional as F

# Break-even between compile time and the compiled path's higher throughput, measured on 2 CPU cores
# at ESM2-35M (docs/benchmarks.md): below it the eager path finishes first.
COMPILE_MIN_RESIDUES = 80_000
COMPILED_BACKENDS = ("sdpa",)
# Score elements (heads x length x length) per chunk of CPU BF16 attention: a chunk's float32 softmax
# stays within the 2 MiB L2 cache of the cores this was measured on.
SCORE_CHUNK_ELEMENTS = 1 << 19


def _attention_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Unmasked attention of (heads, length, head_dim) q, k, v; softmax in float32."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # fused into the softmax; exact when scale is 1
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)


def attend_spans(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans, compile: Callable, scale: float = 1.0
) -> torch.Tensor:
    """Attention of each sequence over its own tokens, on packed (tokens, heads, head_dim) q, k, v.

    `spans` are the (start, stop) token ranges of the sequences; `scale` multiplies the scores (1.0 when q
    comes pre-scaled, as in ESM2). This is what the padded, masked SDPA computes, without padding or mask.
    FP32 (and GPU) runs SDPA per sequence: on CPU nothing measured faster. CPU BF16 runs the scores, a
    float32 softmax and the weighted sum as compiled matmuls over a few heads at a time, because ATen's
    BF16 CPU flash kernel is slow at small head dims around 600 tokens (`python -m benchmarks.attention_cpu`
    on an AVX512-BF16 CPU: about 1.2x SDPA for ESM2's 20 heads of 24, 1.7x for ESMC's 15 heads of 64; but
    about half of SDPA at 100 tokens, so a lower length bound is still to be measured end to end).
    Sequences longer than sqrt(SCORE_CHUNK_ELEMENTS) tokens keep SDPA: their scores no longer fit the cache.
    The scores are rounded to BF16 before the softmax, as under fair-esm's BF16 autocast.
    """
    chunk_fn = compile(_attention_chunk) if q.dtype == torch.bfloat16 and q.device.type == "cpu" else None
    heads, outputs = q.shape[1], []
    for a, b in spans:
        if chunk_fn is not None and (b - a) ** 2 <= SCORE_CHUNK_ELEMENTS:
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
            # Contiguous chunks of at least two heads: strides, storage offsets and sizes of 0 or 1 are
            # specialized by the compiler, so anything else would recompile the function mid-job.
            chunks = heads // max(2, min(heads, SCORE_CHUNK_ELEMENTS // (b - a) ** 2)) or 1
            parts = [
                chunk_fn(*(t.contiguous() for t in chunk), scale)
                for chunk in zip(*(t.tensor_split(chunks) for t in (qs, ks, vs)), strict=True)
            ]
            outputs.append(torch.cat(parts).transpose(0, 1))
        else:
            qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
            outputs.append(F.scaled_dot_product_attention(qs, ks, vs, scale=scale)[0].transpose(0, 1))
    return torch.cat(outputs)


def run_layers_packed(layers, valid: torch.Tensor, h, cos, sin, compile: Callable, scale: float = 1.0):
    """Encoder layers on packed tokens `h` of the rows of `valid`, one sequence per row: each layer's
    `attention_inputs` and `finish` compiled (once per layer class) around `attend_spans`."""
    bounds = [0, *valid.sum(-1).cumsum(0).tolist()]
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    before, after = compile(type(layers[0]).attention_inputs), compile(type(layers[0]).finish)
    for layer in layers:
        q, k, v = before(layer, h, cos, sin)  # (tokens, heads, head_dim) each
        h = after(layer, h, attend_spans(q, k, v, spans, compile, scale))
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
