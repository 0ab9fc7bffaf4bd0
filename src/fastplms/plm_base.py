"""What every fastplms model shares: manifest-declared backends and dtypes, and `embed_dataset`.

Runtime module (ships inside every artifact). The config carries the family's declared backends,
dtypes and BF16 policy (baked in from its manifest); this base class makes them binding:

- `from_pretrained(attn_implementation=...)` and `set_attn_implementation(...)` both validate here
  and end in `config._attn_implementation`, which every layer reads at call time. Transformers' own
  check (which can substitute an unpinned hub kernel or fall back to another backend) is replaced.
- parameter storage and autocast dtypes outside the declaration raise before inference.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from .attention import check_backend, warn_eager_for_attentions
from .compiled import COMPILE_MIN_RESIDUES, COMPILED_BACKENDS, CompiledEmbedding, weights_key
from .embedding import EmbeddingResult, ResidueEncoder, embed_dataset

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FastPLMPreTrainedModel(PreTrainedModel):
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = True
    _supports_attention_backend = True

    # ------------------------------------------------------------------ attention backend
    def _check_and_adjust_attn_implementation(
        self, attn_implementation, is_init_check: bool = False, allow_all_kernels: bool = False
    ) -> str:
        allowed = self.config.allowed_backends
        if attn_implementation is None:
            # Unspecified: Transformers' usual choice, SDPA, when the family declares it.
            return "sdpa" if "sdpa" in allowed else allowed[0]
        return check_backend(attn_implementation, allowed, family=self.config.family)

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
        """kernels.lock of the artifact this model was loaded from (None: the source checkout's)."""
        source = getattr(self.config, "_name_or_path", "") or ""
        if not source:
            return None
        from transformers.utils import cached_file

        try:
            return cached_file(
                source,
                "kernels.lock",
                _raise_exceptions_for_missing_entries=False,
                _raise_exceptions_for_connection_errors=False,
            )
        except OSError:
            return None

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
    def residue_encoder(self) -> ResidueEncoder:
        raise NotImplementedError

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

    def model_fingerprint(self) -> dict[str, object]:
        """Identity of weights and settings, so a resumed embedding run is refused on a different model.

        Weights are hashed byte for byte: a floating-point sum would depend on the reduction order, so
        the same weights would look different under another thread count or on another device.
        """
        config = {k: v for k, v in self.config.to_dict().items() if not k.startswith("_")}
        config.pop("transformers_version", None)
        digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
        with torch.no_grad():
            for name, tensor in self.state_dict().items():
                data = tensor.detach().to("cpu").contiguous()
                digest.update(f"{name} {data.dtype} {tuple(data.shape)}".encode())
                if data.nbytes:  # the raw buffer, read in place (no numpy in runtime modules)
                    digest.update(memoryview((ctypes.c_char * data.nbytes).from_address(data.data_ptr())))
        # Not the path the model was loaded from: the same weights reached through a relative path, an
        # absolute one or a Hub id are the same model.
        return {"model_sha256": digest.hexdigest()[:16]}

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

        `compile`: None (default) runs the compiled path (see `compiled.py`) for jobs of at least
        `COMPILE_MIN_RESIDUES` residues or when this model has compiled it already, else eager;
        True/False force it on or off. Both paths compute the same function.
        """
        if dtype not in self.config.allowed_dtypes:
            raise ValueError(f"dtype {dtype!r} is not declared for {self.config.family}: {self.config.allowed_dtypes}")
        device = next(self.parameters()).device
        autocast = (
            torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext()
        )
        compiled = self._compiled_embedding(compile)
        use_compiled = False

        def plan(residues: int | None) -> None:
            nonlocal use_compiled
            if compiled is not None:
                warm = compiled.calls > 0
                use_compiled = bool(compile) or warm or (residues is not None and residues >= COMPILE_MIN_RESIDUES)

        def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            with autocast:
                if use_compiled:
                    return compiled(input_ids, attention_mask).float()
                return self.embedding_forward(input_ids, attention_mask).float()

        fingerprint = {**self.model_fingerprint(), "dtype": dtype, "backend": self.attention_backend()}
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
            )
        finally:
            self.train(was_training)


def classification_loss(config, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sequence-classification loss chosen as Transformers does (`problem_type`, else from labels)."""
    problem = config.problem_type
    if problem is None:
        if config.num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    if problem == "regression":
        if config.num_labels == 1:
            return F.mse_loss(logits.squeeze(-1).float(), labels.float().view(-1))
        # Several regression targets: one per label, compared elementwise.
        return F.mse_loss(logits.float(), labels.float().view_as(logits))
    if problem == "single_label_classification":
        return F.cross_entropy(logits.view(-1, config.num_labels).float(), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float())
