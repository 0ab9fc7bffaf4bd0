"""ANKH parity against Transformers' `T5ForConditionalGeneration` / `T5EncoderModel` on the same seeded weights.

The reference measured Transformers 5.13's T5 bit-identical to the pinned 4.25.1 the official ANKH code runs
(every encoder state, logits, greedy generation), so it is the oracle, built with the tie trap avoided
(`oracles.t5`). Two weight sets: ankh_base at its real dimensions (48/24 layers, 768 wide, gated GELU, 144
tokens), and a gated-SiLU, 256-token configuration at ANKH3-large width with 4/2 layers (the reference's
second oracle configuration; the full 1.9B model does not fit this machine's parity budget twice over).
Compared: every encoder hidden state and the decoder logits at every position (padding included), and
greedy generation token for token.
"""

from __future__ import annotations

import torch
from transformers.initialization import no_init_weights

from ..configuration_ankh import ANKHConfig
from ..convert.ankh import canonical_keys, from_transformers
from ..manifest import MANIFEST_DIR, Checkpoint, load_manifest
from ..modeling_ankh import ANKHForConditionalGeneration
from ..oracles.t5 import T5Dims, t5_oracle, t5_spec, t5_state_dict
from ..parity.driver import (
    ParityRun,
    conversion_shapes_record,
    cpu_autocast,
    dims_record,
    hidden_states_record,
    logits_record,
    meta_state_shapes,
    package_versions,
)

_PACKAGES = ("torch", "transformers", "numpy")
GENERATED_TOKENS = 8


def ankh_family():
    return load_manifest(MANIFEST_DIR / "ankh.toml", resolve=False)


def checkpoint_dims(checkpoint: Checkpoint, family=None, *, layers: tuple[int, int] | None = None) -> T5Dims:
    """T5 dims of a manifest checkpoint (every field known offline), optionally at another depth."""
    family = family or ankh_family()
    config = family.checkpoint_config(checkpoint.id)
    missing = [k for k in ("num_decoder_layers", "d_kv", "intermediate_size", "feed_forward_proj") if k not in config]
    if missing:
        raise ValueError(f"{checkpoint.id}: {missing} are read from the snapshot; no dims to seed weights at")
    encoder, decoder = layers or (checkpoint.num_layers, config["num_decoder_layers"])
    return T5Dims(
        encoder,
        decoder,
        checkpoint.hidden_size,
        checkpoint.num_heads,
        config["d_kv"],
        config["intermediate_size"],
        config["vocab_size"],
        config["feed_forward_proj"],
        config["relative_attention_num_buckets"],
        config["relative_attention_max_distance"],
    )


def ankh_config(dims: T5Dims) -> ANKHConfig:
    return ANKHConfig(
        vocab_size=dims.vocab,
        hidden_size=dims.hidden,
        num_hidden_layers=dims.num_layers,
        num_decoder_layers=dims.num_decoder_layers,
        num_attention_heads=dims.heads,
        d_kv=dims.d_kv,
        intermediate_size=dims.d_ff,
        feed_forward_proj=dims.activation,
        relative_attention_num_buckets=dims.buckets,
        relative_attention_max_distance=dims.max_distance,
    )


def build_ankh(state: dict[str, torch.Tensor], dims: T5Dims) -> ANKHForConditionalGeneration:
    with no_init_weights():  # every parameter is overwritten by the strict load
        model = ANKHForConditionalGeneration(ankh_config(dims))
    model.load_state_dict(from_transformers(state), strict=True)
    return model.eval()


def ankh_panel(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, decoder_input_ids): residues then `</s>`, right-padded with 0; residue ids
    drawn from the residue range of the vocabulary (3..27 for 144 tokens, 3..30 for 256)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = (1, 12, 37, 120)
    top = 25 if vocab == 144 else 28
    ids = torch.zeros((len(lengths), max(lengths) + 1), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(3, 3 + top, (n,), generator=generator)
        ids[row, n] = 1
    decoder = torch.randint(3, 3 + top, (len(lengths), 9), generator=generator)
    decoder[:, 0] = 0
    return ids, (ids != 0).long(), decoder


@torch.inference_mode()
def measure_ankh(name: str, checkpoint: Checkpoint, dims: T5Dims, seed: int = 0) -> list[dict]:
    """One record per (backend, dtype): encoder states and decoder logits, everywhere; greedy tokens."""
    state = t5_state_dict(dims, seed=seed, with_embed_copies=True)
    oracle = t5_oracle(dims, state)
    ids, mask, decoder = ankh_panel(dims.vocab, seed)
    ref = oracle(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder, output_hidden_states=True)
    ref_tokens = oracle.generate(input_ids=ids, attention_mask=mask, max_new_tokens=GENERATED_TOKENS, do_sample=False)
    del oracle
    model = build_ankh(state, dims)
    del state
    everywhere = torch.ones_like(ids, dtype=torch.bool)
    records = []
    for backend, dtype in (("eager", "float32"), ("sdpa", "float32"), ("sdpa", "bfloat16")):
        model.set_attn_implementation(backend)
        with cpu_autocast(dtype):
            out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder, output_hidden_states=True)
            tokens = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=GENERATED_TOKENS, do_sample=False
            )
        pairs = [
            (a[everywhere].float(), b[everywhere])
            for a, b in zip(out.encoder_hidden_states, ref.encoder_hidden_states, strict=True)
        ]
        records.append(
            {
                "kind": "forward",
                "checkpoint": checkpoint.id,
                "dims": {
                    **dims_record(checkpoint),
                    "layers": dims.num_layers,
                    "decoder_layers": dims.num_decoder_layers,
                },
                "weights": name,
                "oracle": "transformers",
                "oracle_backend": "eager",
                "backend": backend,
                "dtype": dtype,
                "panel": {
                    "description": f"{name}: residue lengths [1, 12, 37, 120] + `</s>`, right-padded; decoder "
                    f"input of 9 tokens; seed {seed}"
                },
                "positions": "all (padding included)",
                "logits": logits_record(out.logits.float(), ref.logits, torch.ones_like(decoder, dtype=torch.bool)),
                "hidden_states": {"count": len(pairs), **hidden_states_record(pairs, range(len(pairs)))},
                "generation": {
                    "greedy_tokens": GENERATED_TOKENS,
                    "identical": bool(torch.equal(tokens, ref_tokens)),
                    "tokens_equal": int((tokens == ref_tokens).sum()) if tokens.shape == ref_tokens.shape else 0,
                    "tokens": ref_tokens.numel(),
                },
            }
        )
    return records


def check_ankh_conversion_shapes(checkpoint: Checkpoint) -> dict[str, object]:
    """The official T5 layout at the checkpoint's real dims as meta tensors, converted, against ours."""
    dims = checkpoint_dims(checkpoint)
    state = {k: torch.empty(s, device="meta") for k, s in t5_spec(dims).items()}
    converted = from_transformers(state)
    assert set(converted) == canonical_keys(dims.num_layers, dims.num_decoder_layers)
    return conversion_shapes_record(
        checkpoint, meta_state_shapes(ANKHForConditionalGeneration, ankh_config(dims)), {"transformers": converted}
    )


def versions() -> dict[str, str]:
    return package_versions(_PACKAGES)


def measure_report(run: ParityRun) -> None:
    family = ankh_family()
    base, large3 = family.checkpoint("ankh_base"), family.checkpoint("ankh3_large")
    run.log("ankh_base: real dims, eager and sdpa FP32, sdpa BF16 autocast, vs Transformers T5")
    run.records += measure_ankh("ankh_base", base, checkpoint_dims(base, family), seed=run.seed)
    run.save()
    run.log("ankh3_large width, gated SiLU, 256 tokens, 4/2 layers")
    run.records += measure_ankh(
        "ankh3_large width at 4/2 layers", large3, checkpoint_dims(large3, family, layers=(4, 2)), seed=run.seed
    )
    run.save()
    for checkpoint in family.checkpoints:
        if checkpoint.from_snapshot:
            run.notes.append(
                f"{checkpoint.id}: {', '.join(checkpoint.from_snapshot)} not known offline (read from the "
                "snapshot at build); no conversion shape check at guessed dims."
            )
            continue
        run.records.append(check_ankh_conversion_shapes(checkpoint))
    run.save()
    run.notes.append(
        "Oracle: Transformers 5.13 T5ForConditionalGeneration (eager, its only backend), which the reference "
        "measured bit-identical to the pinned 4.25.1 that the official ANKH code uses. Encoder hidden states: all "
        "of them, at every position (padding included); logits: the decoder's, on a 9-token decoder input; "
        "greedy generation of 8 tokens compared token for token."
    )
    generated = [r for r in run.records if "generation" in r]
    for r in generated:
        g = r["generation"]
        run.notes.append(
            f"{r['weights']}, {r['backend']} {r['dtype']}: greedy generation of {g['greedy_tokens']} tokens "
            f"{'identical to' if g['identical'] else 'differs from'} Transformers' "
            f"({g['tokens_equal']}/{g['tokens']} tokens)."
        )
    run.notes.append(
        "The ankh3_large rows use its width, heads, FFN, activation and vocabulary at 4 encoder and 2 decoder "
        "layers (not its 48/24): the depth is the only reduced dimension."
    )
