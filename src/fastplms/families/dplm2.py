"""DPLM2's adapter: airkingbd `EsmForDPLM2` snapshots, the DPLM2 config, its 8,229-token tokenizer."""

from __future__ import annotations

import functools

from ..configuration_dplm2 import DPLM2Config
from ..tokenization_dplm2 import DPLM2_VOCAB, VOCAB_SIZE
from . import dplm2_parity
from .adapter import FamilyAdapter, Parity, Tokenizer, manifest_config, tokenized_inputs
from .dplm import VERIFY_SEQUENCES, byprot_reader

USAGE = """\
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer

model = AutoModelForMaskedLM.from_pretrained("<this repo>", trust_remote_code=True)  # sdpa, the only backend
tokenizer = AutoTokenizer.from_pretrained("<this repo>", trust_remote_code=True)
# a packed row: structure tokens (4-digit codes, one per residue) and the amino acids
batch = tokenizer.pack(structures=["0012,0451,8191"], sequences=["MKT"], return_tensors="pt")
logits = model(input_ids=batch["input_ids"]).logits  # (1, 10, 8229)

# generate: co-generation, folding (structure from sequence), inverse folding (sequence from structure)
torch.manual_seed(0)
ids, fixed = model.generate_inputs([100] * 2)
both = model.generate(ids, max_iter=100, partial_masks=fixed)  # annealing@2.2:1.0, stochastic1.0
ids, fixed = model.generate_inputs(sequences=["MKTAYIAKQRQISFVKSHFSRQ"])
folded = model.generate(ids, max_iter=100, partial_masks=fixed, sampling_strategy="argmax",
                        unmasking_strategy="deterministic")
print(tokenizer.decode_structure(folded[0, : folded.shape[1] // 2]))  # packed: structure half first

# embed a whole FASTA file of amino-acid sequences (mean-pooled, special tokens excluded)
result = model.embed_dataset("proteins.fasta", pooling=("mean",))
"""

ADAPTER = FamilyAdapter(
    read_snapshot=byprot_reader("dplm2_esm", VOCAB_SIZE, tied=False),
    make_config=functools.partial(manifest_config, DPLM2Config),
    pretrained_auto_class="AutoModelForMaskedLM",
    example_inputs=tokenized_inputs(VERIFY_SEQUENCES),
    tokenizer=Tokenizer("tokenization_dplm2", DPLM2_VOCAB, 1026, VERIFY_SEQUENCES),
    usage=USAGE,
    parity=Parity(dplm2_parity.measure_report, dplm2_parity.versions),
)
