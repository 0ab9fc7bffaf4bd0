"""What every fastplms model shares: manifest-declared backends and dtypes, and `embed_dataset`.

Runtime module (ships inside every artifact). The config carries the family's declared backends,
dtypes and BF16 policy (baked in from its manifest); this base class makes them binding:

- `from_pretrained(attn_implementation=...)` and `set_attn_implementation(...)` both validate here
  and end in `config._attn_implementation`, which every layer reads at call time. Transformers' own
  check (which can substitute an unpinned hub kernel or fall back to another backend) is replaced.
- parameter storage and autocast dtypes outside the declaration raise before inference.

It also holds what every model class of every family shares: input checks, weight initialization that
leaves loaded tensors alone, and one `forward` with the keyword contract (below); a family's base model
provides `encode`, a task class its head's `head_output` (`heads.py`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import inspect
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutput
from transformers.utils import ModelOutput

from .attention import (
    FLASH_BACKENDS,
    AttentionPlan,
    MaskState,
    attend,
    attention_plan,
    check_backend,
    pad,
    warn_eager_for_attentions,
)
from .compiled import COMPILED_BACKENDS, CompiledEmbedding, PathChoice, weights_key
from .embedding import EmbeddingResult, ResidueEncoder, embed_dataset
from .heads import MaskedLMHead

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Encoded:
    """A base model's encoding, packed: `h` (valid tokens, d) final states, rows of `indices` in (batch, seq).

    `hidden` holds the input to every layer followed by the final normalized output (so its last entry is
    `h`), `attentions` each layer's maps; None when not requested.
    """

    h: torch.Tensor
    indices: torch.Tensor
    batch: int
    seq: int
    hidden: list[torch.Tensor] | None = None
    attentions: list[torch.Tensor] | None = None

    def padded(self, packed: torch.Tensor) -> torch.Tensor:
        """`packed` (valid tokens, ...) back to (batch, seq, ...), zeros at padding."""
        return pad(packed, self.indices, self.batch, self.seq)

    def hidden_states(self) -> tuple[torch.Tensor, ...] | None:
        return None if self.hidden is None else tuple(self.padded(x) for x in self.hidden)

    def attention_maps(self) -> tuple[torch.Tensor, ...] | None:
        return None if self.attentions is None else tuple(self.attentions)


def check_input_ids(input_ids: object, vocab_size: int, max_tokens: int | None = None, family: str = "") -> None:
    """input_ids must be an integer tensor (batch, seq) of ids in [0, vocab_size), at most `max_tokens` long.

    Checked before any compute, so a wrong input is a ValueError that says what is wrong rather than an
    index error from inside the embedding (or, for float ids, a silent cast).
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a tensor of shape (batch, seq); received {shape}.")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be integer token ids; received dtype {input_ids.dtype}.")
    if max_tokens is not None and input_ids.shape[1] > max_tokens:
        raise ValueError(
            f"input has {input_ids.shape[1]} tokens; {family} supports at most {max_tokens} "
            f"({max_tokens - 2} residues plus <cls> and <eos>). Truncate with tokenizer(..., truncation=True)."
        )
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
        raise ValueError(f"input_ids must lie in [0, {vocab_size}).")


def weights_sha256(model: nn.Module, config_json: str) -> str:
    """16 hex digits of sha256 over `config_json` and every state-dict tensor's name, dtype, shape and bytes."""
    digest = hashlib.sha256(config_json.encode())
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            data = tensor.detach().to("cpu").contiguous()
            digest.update(f"{name} {data.dtype} {tuple(data.shape)}".encode())
            if data.nbytes:  # the raw buffer, read in place (no numpy in runtime modules)
                digest.update(memoryview((ctypes.c_char * data.nbytes).from_address(data.data_ptr())))
    return digest.hexdigest()[:16]


@functools.cache
def encode_inputs(encoder_class: type) -> frozenset[str]:
    """The family's own inputs besides input_ids and attention_mask: the other named parameters of its
    base model's `encode` (ESMC: `sequence_id`), the one place they are declared."""
    parameters = list(inspect.signature(encoder_class.encode).parameters.values())[3:]
    return frozenset(p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)


class AttentionLayer(nn.Module):
    """A pre-norm encoder layer on packed tokens: `attention_inputs` (q, k, v as (tokens, heads, head_dim)),
    the facade, then `finish` (output projection, residuals, MLP). Families define the two halves and
    `attention_scale`; the compiled embedding path compiles the same two halves (`compiled.py`)."""

    attention_scale: float | None = None

    def forward(self, h: torch.Tensor, cos, sin, plan: AttentionPlan, want_probs: bool = False):
        q, k, v = self.attention_inputs(h, cos, sin)
        result = attend(q, k, v, plan, scale=self.attention_scale, return_probs=want_probs)
        out, probs = result if want_probs else (result, None)
        return self.finish(h, out), probs


def run_encoder(layers, final_norm, h, cos, sin, plan: AttentionPlan, want_hidden: bool, want_probs: bool):
    """Layers then the final norm on packed tokens: (final states, hidden states or None, maps or None).

    Hidden states follow the convention: the input to every layer, then the final normalized output.
    """
    hidden = [] if want_hidden else None
    attentions = [] if want_probs else None
    for layer in layers:
        if want_hidden:
            hidden.append(h)
        h, probs = layer(h, cos, sin, plan, want_probs)
        if want_probs:
            attentions.append(probs)
    h = final_norm(h)
    if want_hidden:
        hidden.append(h)
    return h, hidden, attentions


class FastPLMPreTrainedModel(PreTrainedModel):
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = True
    _supports_attention_backend = True
    # `forward` ignores num_items_in_batch, so Trainer must average the loss over gradient accumulation
    # itself; without this it would read the **inputs of `forward` as "takes loss kwargs" and not do so.
    accepts_loss_kwargs = False

    # ------------------------------------------------------------------ forward contract
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        inputs_embeds: None = None,
        num_items_in_batch: object = None,
        **inputs: torch.Tensor | None,
    ) -> ModelOutput | tuple:
        """Encode `input_ids`, apply this class's head, return its ModelOutput (or, with return_dict False,
        `to_tuple()`, as Transformers does: None fields dropped).

        `inputs` are the family's own inputs (see `encode_inputs`); any other keyword is a TypeError naming
        it, so a misspelt `attention_masks=` or an unused `position_ids=` cannot be dropped silently.
        Trainer and PEFT pass `inputs_embeds=None`, `labels`, `return_dict`, `output_*` and
        `num_items_in_batch`: accepted; `num_items_in_batch` is ignored, and `inputs_embeds` must be None
        (these models embed token ids themselves; token dropout rescales by the <mask> count).
        `output_*` and `return_dict` default to the config's, as in Transformers.
        """
        unknown = sorted(set(inputs) - encode_inputs(type(self.base_model)))
        if unknown:
            raise TypeError(f"{type(self).__name__}.forward() got an unexpected keyword argument {unknown[0]!r}")
        if inputs_embeds is not None:
            raise ValueError(f"{type(self).__name__} takes input_ids only; inputs_embeds is not supported.")
        config = self.config
        hidden = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        maps = config.output_attentions if output_attentions is None else output_attentions
        encoded = self.base_model.encode(
            input_ids, attention_mask, output_hidden_states=bool(hidden), output_attentions=bool(maps), **inputs
        )
        output = self.head_output(encoded, labels)
        return output if (config.return_dict if return_dict is None else return_dict) else output.to_tuple()

    def head_output(self, encoded: Encoded, labels: torch.Tensor | None) -> ModelOutput:
        """The base model's output; task classes (`heads.py`) override it with their head."""
        if labels is not None:
            raise ValueError(f"{type(self).__name__} has no task head to compute a loss from labels.")
        return BaseModelOutput(
            last_hidden_state=encoded.padded(encoded.h),
            hidden_states=encoded.hidden_states(),
            attentions=encoded.attention_maps(),
        )

    def max_tokens(self) -> int | None:
        """Longest input (special tokens included) the family accepts; None where it has no limit."""
        return None

    def check_input_ids(self, input_ids: torch.Tensor) -> None:
        check_input_ids(input_ids, self.config.vocab_size, self.max_tokens(), self.config.family)

    def checked_backend(self, input_ids: torch.Tensor, output_attentions: bool, warn_eager: bool = True) -> str:
        """What every `encode` starts with: check the ids and the dtypes, then pick this call's backend."""
        self.check_input_ids(input_ids)
        self.check_dtypes(input_ids.device.type)
        return self.attention_backend(output_attentions, warn=warn_eager)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # transformers.initialization leaves tensors loaded from a checkpoint alone; plain in-place ops would
        # overwrite e.g. a loaded Linear weight whose bias is missing from the checkpoint.
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, 0.0, 0.02)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, 0.0, 0.02)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, MaskedLMHead) and module.bias is not None:
            init.zeros_(module.bias)

    # ------------------------------------------------------------------ attention backend
    def _check_and_adjust_attn_implementation(
        self, attn_implementation, is_init_check: bool = False, allow_all_kernels: bool = False
    ) -> str:
        allowed = self.config.allowed_backends
        if attn_implementation is None:
            # Unspecified: Transformers' usual choice, SDPA, when the family declares it.
            return "sdpa" if "sdpa" in allowed else allowed[0]
        reasons = getattr(self.config, "unsupported_backends", None)
        return check_backend(attn_implementation, allowed, family=self.config.family, reasons=reasons)

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return True

    def set_attn_implementation(self, attn_implementation: str, allow_all_kernels: bool = False) -> None:
        """Switch the attention backend at runtime; every layer follows the config."""
        self.config._attn_implementation_internal = self._check_and_adjust_attn_implementation(attn_implementation)

    def attention_backend(self, output_attentions: bool = False, *, warn: bool = True) -> str:
        """Backend for one forward call: the configured one, or eager when attentions are requested."""
        backend = self.config._attn_implementation or self._check_and_adjust_attn_implementation(None)
        if output_attentions and backend != "eager":
            if warn:
                warn_eager_for_attentions(backend)
            return "eager"
        return backend

    def flash_lockfile(self) -> str | None:
        """kernels.lock of the artifact this model was loaded from (None: the source checkout's), looked
        up once per model and source."""
        source = getattr(self.config, "_name_or_path", "") or ""
        cached = self.__dict__.get("_fastplms_lockfile")
        if cached is not None and cached[0] == source:
            return cached[1]
        path = None
        if source:
            from transformers.utils import cached_file

            try:
                path = cached_file(
                    source,
                    "kernels.lock",
                    _raise_exceptions_for_missing_entries=False,
                    _raise_exceptions_for_connection_errors=False,
                )
            except OSError:
                path = None
        self.__dict__["_fastplms_lockfile"] = (source, path)
        return path

    def attention_plan(self, backend: str, state: MaskState) -> AttentionPlan:
        """The forward's attention plan (`attention.attention_plan`), with this model's kernels.lock and its
        flash kernels, loaded once per model (a plain attribute: never in state_dict or modules)."""
        lockfile = self.flash_lockfile() if backend in FLASH_BACKENDS else None
        kernels = self.__dict__.setdefault("_fastplms_kernels", {})
        return attention_plan(backend, state, flash_lockfile=lockfile, kernels=kernels)

    # ------------------------------------------------------------------ dtypes
    def check_dtypes(self, device_type: str) -> None:
        """Refuse parameter storage or an autocast dtype that the family does not declare."""
        allowed = self.config.allowed_dtypes
        storage = next(self.parameters()).dtype
        storage_ok = storage == torch.float32 or (
            self.config.bf16_policy == "cast" and storage in {DTYPES[d] for d in allowed}
        )
        if not storage_ok:
            raise ValueError(
                f"{self.config.family} parameters are stored as {storage}; this family declares "
                f"{', '.join(allowed)} with BF16 policy {self.config.bf16_policy!r}: keep parameters in "
                "float32 and run under torch.autocast(device_type, dtype=torch.bfloat16)."
            )
        if torch.is_autocast_enabled(device_type):
            active = torch.get_autocast_dtype(device_type)
            if active not in {DTYPES[d] for d in allowed}:
                raise ValueError(
                    f"{self.config.family} does not declare autocast dtype {active}; declared: {', '.join(allowed)}."
                )

    # ------------------------------------------------------------------ embedding
    # What `residue_encoder` reads: the family's token list (index = id) and the residue letters it embeds.
    vocabulary: tuple[str, ...] = ()
    residues: str = ""

    def residue_encoder(self) -> ResidueEncoder:
        """Residues to ids as the family's tokenizer encodes them: `<cls> residues <eos>`; a family with
        another layout overrides this."""
        config = self.config
        ids = {token: i for i, token in enumerate(self.vocabulary)}
        return ResidueEncoder(
            alphabet=frozenset(self.residues),
            to_id={r: ids[r] for r in self.residues},
            prefix=(config.cls_token_id,),
            suffix=(config.eos_token_id,),
            pad_id=config.pad_token_id,
            max_residues=config.max_position_embeddings - 2,
        )

    def embedding_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def _compiled_embedding(self, compile: bool | None) -> CompiledEmbedding | None:
        """This model's compiled embedding path (built lazily, kept on the instance), or None where
        it does not apply: `compile=False`, a model without `embedding_core`, an overridden
        `embedding_forward`, or a backend without a compiled path (flex compiles its own kernel)."""
        base = self.base_model
        supported = (
            hasattr(base, "embedding_core")
            and type(self).embedding_forward is FastPLMPreTrainedModel.embedding_forward
            and self.attention_backend() in COMPILED_BACKENDS
        )
        if compile is True and not supported:
            raise ValueError(
                f"compile=True needs attention backend {' or '.join(COMPILED_BACKENDS)} "
                f"(configured: {self.attention_backend()!r}) and the model's own embedding forward"
            )
        if compile is False or not supported:
            return None
        runner = self.__dict__.get("_fastplms_compiled")
        if runner is None or runner.key != weights_key(base):  # new, or weights changed since: rebuild
            runner = CompiledEmbedding(base)
            # Plain attribute, not a submodule: it must not appear in state_dict() or modules().
            self.__dict__["_fastplms_compiled"] = runner
        return runner

    def embedding_groups(self):
        """None, or the (group, group_digest) pair `embedding.embed_dataset` takes, for a family whose records
        run in groups (E1's per-record retrieval contexts); `embedding_forward` then receives each batch's key."""
        return None

    def model_fingerprint(self) -> dict[str, object]:
        """Identity of weights and settings, so a resumed embedding run is refused on a different model.

        Weights are hashed byte for byte: a floating-point sum would depend on the reduction order, so
        the same weights would look different under another thread count or on another device. Hashing
        reads every weight byte (about 12 GB for ESM2-3B), so the result is kept on the instance until a
        parameter or buffer is replaced or modified in place (`compiled.weights_key`) or the config changes.
        """
        config = {k: v for k, v in self.config.to_dict().items() if not k.startswith("_")}
        config.pop("transformers_version", None)
        config_json = json.dumps(config, sort_keys=True, default=str)
        key = (weights_key(self), config_json)
        cached = self.__dict__.get("_fastplms_fingerprint")
        if cached is None or cached[0] != key:
            # Plain attribute, not a submodule or buffer: it must not appear in state_dict().
            cached = self.__dict__["_fastplms_fingerprint"] = (key, weights_sha256(self, config_json))
        # Not the path the model was loaded from: the same weights reached through a relative path, an
        # absolute one or a Hub id are the same model.
        return {"model_sha256": cached[1]}

    def embed_dataset(
        self,
        inputs,
        *,
        max_tokens_per_batch: int = 4096,
        batch_size: int | None = None,
        max_length: int | None = None,
        pooling: str | Sequence[str] = ("mean",),
        per_residue: bool = False,
        output=None,
        resume: bool = False,
        overwrite: bool = False,
        invalid: str = "raise",
        too_long: str = "raise",
        dtype: str = "float32",
        progress: Callable[[int, int, int | None], None] | None = None,
        compile: bool | None = None,
    ) -> EmbeddingResult:
        """Embed a FASTA file, .txt file, mapping, list or (id, sequence) pairs; see fastplms docs.

        `compile`: None (default) lets `compiled.PathChoice` pick per batch: the first batch eager, the rest
        compiled where the measured eager rate says the compile pays back (or the model compiled before), and
        eager again if the compiled path measures slower; True/False force it on or off. Both paths compute
        the same function.
        """
        if dtype not in self.config.allowed_dtypes:
            raise ValueError(f"dtype {dtype!r} is not declared for {self.config.family}: {self.config.allowed_dtypes}")
        device = next(self.parameters()).device
        autocast = (
            torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext()
        )
        compiled = self._compiled_embedding(compile)
        choice = PathChoice(compiled, compile, None, self.config.hidden_size)

        def plan(residues: int | None) -> None:
            choice.residues = residues

        grouping = self.embedding_groups()

        def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor, *key) -> torch.Tensor:
            path = choice.next()
            calls = compiled.calls if compiled is not None else 0
            started = time.perf_counter()
            with autocast:
                if path == "compiled":
                    out = compiled(input_ids, attention_mask).float()
                else:
                    out = self.embedding_forward(input_ids, attention_mask, *key).float()
            if choice.measuring:
                if out.device.type == "cuda":  # kernels run asynchronously: time them, not their launch
                    torch.cuda.synchronize(out.device)
                choice.record(path, time.perf_counter() - started, attention_mask, path == "compiled" and calls == 0)
            return out

        fingerprint = {"dtype": dtype, "backend": self.attention_backend()}
        if output is not None:  # only an output can be resumed; in memory, the weights need no hash
            fingerprint = {**self.model_fingerprint(), **fingerprint}
        was_training = self.training
        self.eval()
        try:
            return embed_dataset(
                forward,
                self.residue_encoder(),
                inputs,
                max_tokens_per_batch=max_tokens_per_batch,
                batch_size=batch_size,
                max_length=max_length,
                pooling=pooling,
                per_residue=per_residue,
                output=output,
                resume=resume,
                overwrite=overwrite,
                invalid=invalid,
                too_long=too_long,
                fingerprint=fingerprint,
                progress=progress,
                device=device,
                plan=plan,
                group=None if grouping is None else grouping[0],
                group_digest=None if grouping is None else grouping[1],
            )
        finally:
            self.train(was_training)
