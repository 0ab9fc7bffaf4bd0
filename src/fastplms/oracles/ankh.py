"""ANKH (ElnaggarLab T5 v1.1 protein models) oracles.

Tokenizer files
---------------
The official ``tokenizer.json`` (ANKH v1/v2) and ``spiece.model`` (ANKH3) cannot be fetched offline, so the
builders below write files **in the official format** for the tests: what the official loaders read
(agemagician/Ankh@02b4e25 ``ankh_transformers.py``: ``AutoTokenizer`` on ``tokenizer.json`` for ankh-base/large,
the slow SentencePiece ``T5Tokenizer`` on ``spiece.model`` for ankh3-large/xl), laid out as T5 lays them out.

What is **measured** and what is **reconstructed**:

- Measured (the FastPLMs goldens at Synthyra/FastPLMs@1f78282: their three ``input_ids`` rows, produced by the
  official tokenizer in the pinned transformers 4.25.1 / tokenizers 0.13.3 stack, are the seed-42 sequences
  ``"M" + random.Random(42).choices("ACDEFGHIKLMNPQRSTVWY", k=n - 1)`` for n = 61, 29, 13): the ids of all 20
  canonical residues, ``ANKH_V1_CANONICAL`` at 3..22 (ankh-base, ankh-large and ankh2 share one tokenizer.json)
  and ``ANKH3_CANONICAL`` at 7..26 (ankh3-large and -xl share one tokenizer.json and spiece.model); ``<pad>`` 0,
  ``</s>`` 1 and right padding; no leading ``<unk>`` and exactly one id per residue for raw strings under the
  official 4.25.1 stack. ``GOLDEN_ROWS`` holds those rows.
- Reconstructed (plausible, **not** the official bytes): ``<unk>`` 2; the rare residues ``X B Z U O`` right after
  the canonical ones, in that order; ``<unused_i>`` filler pieces up to the official sizes (144 ids for v1/v2 and
  256 for ANKH3, each = its base pieces + 100 T5 sentinels, ``<extra_id_0>`` last, as T5 numbers them); in
  ANKH3 ``[NLU]`` 3, ``[S2S]`` 4 (user-defined pieces: the official likelihood code prepends them to the raw
  string and skips exactly one token, so they must encode whole) and ``"▁"`` 5; scores; the ``spiece.model``
  normalizer (identity, no dummy prefix: with a dummy prefix the official per-residue encoding would not be one
  id per residue); the v1 pre-tokenizer (see below).

The v1 pre-tokenizer. A T5-converted file has ``Metaspace(add_prefix_space=true)``. Measured with transformers
4.25.1 / tokenizers 0.13.3 (the official ANKH stack) on such a file, where ``"▁"`` is not a piece, raw
``"MCAD"`` encodes as ``<unk> M C A D </s>`` and ``list("MCAD")`` with ``is_split_into_words=True`` as
``<unk> M <unk> C <unk> A <unk> D </s>`` (every word gets its own ``▁``). The FastPLMs goldens (raw strings
through the official ``AutoTokenizer``) show neither, so the official file's pre-tokenizer does not prepend
``▁``; tokenizers 0.22 cannot even read the 0.13-era ``Metaspace(add_prefix_space=false)``, and 0.13.3 cannot
read the newer ``prepend_scheme`` form. ``ankh_v1_tokenizer_json`` therefore writes ``WhitespaceSplit``
(``pre_tokenizer="whitespace"``, the default) and offers the T5 converter's ``Metaspace`` as
``pre_tokenizer="metaspace"``. Transformers 5.13 ignores either: its ``T5Tokenizer`` (what ``AutoTokenizer``
and ``T5TokenizerFast`` return for these folders) rebuilds ``WhitespaceSplit + Metaspace(prepend_scheme=
"always")`` from the vocabulary, so on both files raw strings get one leading ``<unk>`` and
``is_split_into_words`` input an ``<unk>`` before every residue (measured).

``official_fast_ids`` / ``official_slow_t5_ids`` state what the official 4.25.1 tokenizers compute: the file's own
``tokenizers`` pipeline (``T5TokenizerFast`` in 4.25.1 runs ``tokenizer.json`` as written), and the slow
``T5Tokenizer`` (SentencePiece ``encode`` per word or string, sentinels numbered down from the top,
``</s>`` appended). Both were checked against transformers 4.25.1 + tokenizers 0.13.3 + sentencepiece 0.1.99
on the files written here (``OFFICIAL_4_25_MEASURED`` in the tests).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

# ---------------------------------------------------------------------------------------------------------------
# Tokenizer files in the official ANKH formats (tests only; the runtime tokenizer is tokenization_ankh)
# ---------------------------------------------------------------------------------------------------------------

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
NUM_SENTINELS = 100
SENTINELS: tuple[str, ...] = tuple(f"<extra_id_{i}>" for i in range(NUM_SENTINELS))
# Measured from the FastPLMs goldens (see the module docstring): residue -> id is the position plus the offset.
ANKH_V1_CANONICAL = "ALGVSREDTIPKFQNYMHWC"  # ids 3..22 (ankh-base, ankh-large, ankh2-*)
ANKH3_CANONICAL = "LAGSVERTIDPKNFQYHMCW"  # ids 7..26 (ankh3-large, ankh3-xl)
RARE_RESIDUES = "XBZUO"  # reconstructed: placed right after the canonical residues
ANKH_V1_SIZE, ANKH3_SIZE = 144, 256  # embedding rows = tokenizer ids (base pieces + 100 sentinels)
ANKH3_TASK_PREFIXES = ("[NLU]", "[S2S]")

# The three FastPLMs golden rows (official ids, </s> included, before padding) and the sequences they encode.
GOLDEN_SEQUENCES = (
    "MPAGFRQVCKAFMAEPMFNTATQHEYHCCTPTRMYINTPVNRAFGCFDGPIIFGWPPEREI",
    "MYPNQTSFAHGFWVHQIWLGFNGNVIFYM",
    "MCADPSKCIYMYV",
)
GOLDEN_ROWS: dict[str, tuple[tuple[int, ...], ...]] = {
    "v1": (
        (19, 13, 3, 5, 15, 8, 16, 6, 22, 14, 3, 15, 19, 3, 9, 13, 19, 15, 17, 11, 3, 11, 16, 20, 9, 18, 20, 22, 22, 11,
         13, 11, 8, 19, 18, 12, 17, 11, 13, 6, 17, 8, 3, 15, 5, 22, 15, 10, 5, 13, 12, 12, 15, 5, 21, 13, 13, 9, 8, 9,
         12, 1),
        (19, 18, 13, 17, 16, 11, 7, 15, 3, 20, 5, 15, 21, 6, 20, 16, 12, 21, 4, 5, 15, 17, 5, 17, 6, 12, 15, 18, 19, 1),
        (19, 22, 3, 10, 13, 7, 14, 22, 12, 18, 19, 18, 6, 1),
    ),
    "v3": (
        (24, 17, 8, 9, 20, 13, 21, 11, 25, 18, 8, 20, 24, 8, 12, 17, 24, 20, 19, 14, 8, 14, 21, 23, 12, 22, 23, 25, 25,
         14, 17, 14, 13, 24, 22, 15, 19, 14, 17, 11, 19, 13, 8, 20, 9, 25, 20, 16, 9, 17, 15, 15, 20, 9, 26, 17, 17, 12,
         13, 12, 15, 1),
        (24, 22, 17, 19, 21, 14, 10, 20, 8, 23, 9, 20, 26, 11, 23, 21, 15, 26, 7, 9, 20, 19, 9, 19, 11, 15, 20, 22, 24,
         1),
        (24, 25, 8, 16, 17, 10, 18, 25, 15, 22, 24, 22, 11, 1),
    ),
}  # fmt: skip

# SentencePiece piece types (sentencepiece_model.proto).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED = 1, 2, 3, 4, 5


def _residue_scores(residues: str) -> list[tuple[str, float]]:
    # Log-probability-like scores, most frequent first; with single-character pieces they decide nothing.
    return [(r, round(-2.5 - 0.125 * i, 3)) for i, r in enumerate(residues)]


def _fill(pieces: list[tuple[str, float, int]], base_size: int) -> list[tuple[str, float, int]]:
    while len(pieces) < base_size:
        pieces.append((f"<unused_{len(pieces)}>", -100.0, UNUSED))
    return pieces


def ankh_v1_pieces() -> list[tuple[str, float, int]]:
    """(piece, score, SentencePiece type) of the 44 base ids of the v1/v2 vocabulary, ids 0..43."""
    pieces = [(PAD, 0.0, CONTROL), (EOS, 0.0, CONTROL), (UNK, 0.0, UNKNOWN)]
    pieces += [(p, s, NORMAL) for p, s in _residue_scores(ANKH_V1_CANONICAL + RARE_RESIDUES)]
    return _fill(pieces, ANKH_V1_SIZE - NUM_SENTINELS)


def ankh3_pieces() -> list[tuple[str, float, int]]:
    """(piece, score, type) of the 156 pieces of the ANKH3 ``spiece.model``, ids 0..155."""
    pieces = [(PAD, 0.0, CONTROL), (EOS, 0.0, CONTROL), (UNK, 0.0, UNKNOWN)]
    pieces += [(p, 0.0, USER_DEFINED) for p in ANKH3_TASK_PREFIXES]
    pieces.append(("▁", -2.0, NORMAL))
    pieces = _fill(pieces, 7)
    pieces += [(p, s, NORMAL) for p, s in _residue_scores(ANKH3_CANONICAL + RARE_RESIDUES)]
    return _fill(pieces, ANKH3_SIZE - NUM_SENTINELS)


def _tokenizer_json(pieces: Sequence[tuple[str, float, int]], pre_tokenizer: str) -> str:
    """A T5-style fast tokenizer over ``pieces`` + 100 sentinels, built with the ``tokenizers`` library and
    serialised in the schema both tokenizers 0.13.3 and 0.22 read."""
    from tokenizers import AddedToken, Tokenizer, pre_tokenizers, processors
    from tokenizers.models import Unigram

    vocab = [(p, s) for p, s, _ in pieces] + [(t, 0.0) for t in reversed(SENTINELS)]
    tokenizer = Tokenizer(Unigram(vocab, unk_id=[p for p, _, _ in pieces].index(UNK)))
    if pre_tokenizer == "whitespace":
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    elif pre_tokenizer != "metaspace":  # metaspace: written below in the 0.13-era schema
        raise ValueError(f"pre_tokenizer must be 'whitespace' or 'metaspace', not {pre_tokenizer!r}")
    eos_id = [p for p, _, _ in pieces].index(EOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}", special_tokens=[(EOS, eos_id)]
    )
    specials = [p for p, _, kind in pieces if kind in (CONTROL, UNKNOWN, USER_DEFINED)] + list(reversed(SENTINELS))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    data = json.loads(tokenizer.to_str())
    # tokenizers 0.13.3 reads only the old Metaspace schema, and 0.22 reads it only with add_prefix_space=true.
    metaspace = {"type": "Metaspace", "replacement": "▁", "add_prefix_space": True}
    data["decoder"] = metaspace
    if pre_tokenizer == "metaspace":
        data["pre_tokenizer"] = metaspace
    data["model"].pop("byte_fallback", None)  # absent from 0.13-era files; 0.22 defaults it to false
    return json.dumps(data, ensure_ascii=False, indent=2) + "\n"


def ankh_v1_tokenizer_json(path: str | Path, *, pre_tokenizer: str = "whitespace") -> Path:
    """Write an ANKH v1/v2 ``tokenizer.json`` in the ElnaggarLab/ankh-base format (a reconstruction: see the
    module docstring): Unigram over 144 ids, ``pre_tokenizer`` ``"whitespace"`` (consistent with the goldens) or
    ``"metaspace"`` (the T5 converter's), ``$A </s>``."""
    path = Path(path)
    path.write_text(_tokenizer_json(ankh_v1_pieces(), pre_tokenizer), encoding="utf-8")
    return path


def ankh3_tokenizer_json(path: str | Path) -> Path:
    """Write the fast ``tokenizer.json`` an ANKH3 snapshot carries beside its ``spiece.model`` (the same 256
    ids; the FastPLMs goldens were encoded with it, through ``AutoTokenizer``)."""
    path = Path(path)
    path.write_text(_tokenizer_json(ankh3_pieces(), "whitespace"), encoding="utf-8")
    return path


def ankh3_spiece_model(path: str | Path) -> Path:
    """Write an ANKH3 ``spiece.model`` (a reconstruction: see the module docstring) with the ``sentencepiece``
    library's ModelProto: a Unigram model of 156 pieces, pad 0 / eos 1 / unk 2, no bos, identity normalizer
    without a dummy prefix. The slow ``T5Tokenizer`` adds the 100 sentinels on top: 256 ids."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    pieces = ankh3_pieces()
    proto = model_pb2.ModelProto()
    for piece, score, kind in pieces:
        entry = proto.pieces.add()
        entry.piece, entry.score, entry.type = piece, score, kind
    spec = proto.trainer_spec
    spec.model_type = model_pb2.TrainerSpec.UNIGRAM
    spec.vocab_size = len(pieces)
    spec.pad_id, spec.eos_id, spec.unk_id, spec.bos_id = 0, 1, 2, -1
    spec.pad_piece, spec.eos_piece, spec.unk_piece = PAD, EOS, UNK
    spec.user_defined_symbols.extend(ANKH3_TASK_PREFIXES)
    spec.character_coverage = 1.0
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = False
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    data = proto.SerializeToString()
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(data)  # refuses an inconsistent model
    if processor.GetPieceSize() != len(pieces):
        raise AssertionError("sentencepiece did not load every piece")
    path = Path(path)
    path.write_bytes(data)
    return path


def _snapshot_configs(directory: Path, *, tokenizer_class: str) -> None:
    # tokenizer_config.json / special_tokens_map.json as T5 checkpoints of the transformers 4.25 era carry them.
    special = {"eos_token": EOS, "unk_token": UNK, "pad_token": PAD, "additional_special_tokens": list(SENTINELS)}
    config = {**special, "extra_ids": NUM_SENTINELS, "model_max_length": 1000000000000000019884624838656}
    config["tokenizer_class"] = tokenizer_class
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")


def write_ankh_tokenizer_snapshot(directory: str | Path, generation: str, **kwargs) -> Path:
    """A folder holding the tokenizer files of an official snapshot: ``generation`` ``"v1"`` (ankh-base/large,
    ankh2: tokenizer.json; ``kwargs`` go to ``ankh_v1_tokenizer_json``) or ``"v3"`` (ankh3: spiece.model and
    tokenizer.json), each with tokenizer_config.json and special_tokens_map.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if generation == "v1":
        ankh_v1_tokenizer_json(directory / "tokenizer.json", **kwargs)
    elif generation == "v3":
        ankh3_spiece_model(directory / "spiece.model")
        ankh3_tokenizer_json(directory / "tokenizer.json")
    else:
        raise ValueError(f"generation must be 'v1' or 'v3', not {generation!r}")
    _snapshot_configs(directory, tokenizer_class="T5Tokenizer")
    return directory


def official_fast_ids(
    tokenizer_json: str | Path, sequences: Sequence[str], *, is_split_into_words: bool = True
) -> list[list[int]]:
    """Ids the official v1/v2 path computes: transformers 4.25.1's ``T5TokenizerFast`` runs the file's own
    ``tokenizers`` pipeline, on ``list(seq)`` with ``is_split_into_words=True`` (official extraction) or on the raw
    string (what the FastPLMs goldens ran). No padding."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    inputs = [list(s) for s in sequences] if is_split_into_words else list(sequences)
    return [e.ids for e in tokenizer.encode_batch(inputs, is_pretokenized=is_split_into_words)]


def official_slow_t5_ids(
    spiece_model: str | Path,
    sequence: str,
    *,
    is_split_into_words: bool = True,
    prefix: str | None = None,
    extra_ids: int = NUM_SENTINELS,
) -> list[int]:
    """Ids transformers 4.25.1's slow ``T5Tokenizer(spiece.model)`` gives (the official ANKH3 loader).

    Extraction (``extract.py``) passes ``list(seq)`` with ``is_split_into_words=True``: each word goes through
    ``SentencePieceProcessor.encode(word, out_type=str)`` on its own. The likelihood code passes the raw string
    ``prefix + seq`` (``is_split_into_words=False``). ``<extra_id_i>`` (split off whole before SentencePiece, as
    the slow tokenizer does with its special tokens) is ``piece_count + extra_ids - 1 - i``; ``</s>`` is appended.
    """
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor()
    processor.Load(str(spiece_model))
    size = processor.GetPieceSize()
    texts = list(sequence) if is_split_into_words else [sequence]
    if prefix is not None:
        texts = [prefix, *texts] if is_split_into_words else [prefix + texts[0]]
    ids: list[int] = []
    for text in texts:
        for chunk in re.split(r"(<extra_id_\d+>|</s>|<pad>|<unk>)", text):
            if re.fullmatch(r"<extra_id_\d+>", chunk):
                ids.append(size + extra_ids - 1 - int(chunk[10:-1]))
            elif chunk in (PAD, EOS, UNK):
                ids.append(processor.PieceToId(chunk))
            elif chunk:
                ids += [processor.PieceToId(piece) for piece in processor.Encode(chunk, out_type=str)]
    return [*ids, processor.PieceToId(EOS)]
