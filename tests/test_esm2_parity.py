"""ESM2 parity against both official implementations, at every checkpoint's real dims.

Cases come from the manifest: checkpoints whose forward fits this CPU machine (`forward_feasible`:
8M, 35M, 150M) run ours (converted from each official layout) against Transformers and fair-esm on
every CPU backend; the larger ones get the conversion shape check. One measurement per checkpoint is
shared by all its assertions (module-scoped cache), and the panel is small to keep the file fast
(about 2-3 minutes on 2 cores, including one Flex compile per head dim: 16, 24 and 32).
"""

import math

import pytest

from fastplms.families.esm2_parity import (
    ESM2_ORACLES,
    check_esm2_conversion_shapes,
    esm2_panel,
    forward_feasible,
    measure_esm2,
)
from fastplms.manifest import MANIFEST_DIR, load_manifest
from fastplms.parity.driver import cpu_backends

pytestmark = pytest.mark.slow

FAMILY = load_manifest(MANIFEST_DIR / "esm2.toml", resolve=False)
FORWARD = [c.id for c in FAMILY.checkpoints if forward_feasible(c)]
SHAPES_ONLY = [c.id for c in FAMILY.checkpoints if not forward_feasible(c)]
CPU_BACKENDS = cpu_backends(FAMILY)
# Small but still mixed: a single residue, short and medium rows, padding, <mask> tokens, all 25 letters.
LENGTHS = (1, 12, 40)
TOLERANCE = 1e-5

CASES = [
    pytest.param(checkpoint, oracle, backend, id=f"{checkpoint}-{oracle}-{backend}")
    for checkpoint in FORWARD
    for oracle in ESM2_ORACLES
    for backend in CPU_BACKENDS
]


@pytest.fixture(scope="module")
def measured():
    cache: dict[str, dict[tuple[str, str], dict]] = {}

    def get(checkpoint: str) -> dict[tuple[str, str], dict]:
        if checkpoint not in cache:
            records = measure_esm2(checkpoint, backends=CPU_BACKENDS, lengths=LENGTHS)
            cache[checkpoint] = {(r["oracle"], r["backend"]): r for r in records}
        return cache[checkpoint]

    return get


def test_manifest_has_forward_and_shape_cases():
    assert FORWARD == ["esm2_8m", "esm2_35m", "esm2_150m"]
    assert SHAPES_ONLY == ["esm2_650m", "esm2_3b"]


def test_panel_is_mixed_and_covers_the_alphabet():
    input_ids, attention_mask = esm2_panel(0, LENGTHS)
    assert attention_mask.sum(-1).tolist() == [n + 2 for n in LENGTHS]
    assert (input_ids[attention_mask == 0] == 1).all()  # right padding with <pad>
    residues = set(input_ids[(input_ids >= 4) & (input_ids <= 28)].tolist())
    assert residues == set(range(4, 29))
    masked = (input_ids == 32).sum(-1).tolist()
    assert masked[0] == 0 and all(m >= 1 for m in masked[1:])
    ids_again, mask_again = esm2_panel(0, LENGTHS)
    assert ids_again.equal(input_ids) and mask_again.equal(attention_mask)


@pytest.mark.parametrize(("checkpoint", "oracle", "backend"), CASES)
def test_fp32_parity(measured, checkpoint, oracle, backend):
    record = measured(checkpoint)[(oracle, backend)]
    layers = FAMILY.checkpoint(checkpoint).num_layers
    assert record["dtype"] == "float32"
    assert record["logits"]["relative_l2"] <= TOLERANCE, record["logits"]
    hidden = record["hidden_states"]
    assert hidden["count"] == layers + 1
    assert hidden["worst_relative_l2"] <= TOLERANCE, hidden
    assert record["contacts"]["max_abs"] <= TOLERANCE, record["contacts"]
    assert record["logits"]["top1_agreement_all"] >= 0.99  # an exact near-tie may still flip


@pytest.mark.parametrize("checkpoint", SHAPES_ONLY)
def test_conversion_shapes_at_real_dims(checkpoint):
    record = check_esm2_conversion_shapes(checkpoint)
    assert record["ok"], record["problems"]
    assert record["layouts"] == ["fair-esm", "transformers"]
    spec = FAMILY.checkpoint(checkpoint)
    assert record["dims"] == {"layers": spec.num_layers, "hidden": spec.hidden_size, "heads": spec.num_heads}


def test_bf16_autocast_sanity():
    (record,) = measure_esm2(
        "esm2_8m", backends=("sdpa",), dtype="bfloat16", oracles=("transformers",), lengths=LENGTHS
    )
    assert record["dtype"] == "bfloat16"
    logits = record["logits"]
    assert all(math.isfinite(v) for v in logits.values()), logits
    assert logits["relative_l2"] < 0.05, logits
    assert logits["top1_agreement"] > 0.9, logits
    # Seeded weights leave few confident positions, so argmax agreement over every position is checked too.
    assert logits["top1_agreement_all"] > 0.9, logits
    assert record["hidden_states"]["worst_relative_l2"] < 0.05, record["hidden_states"]
