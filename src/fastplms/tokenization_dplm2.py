"""Strict tokenizer for DPLM2 (multimodal DPLM): an amino-acid track and a structure-token track.

Runtime module: it is copied flat into Hub artifacts and imported by Transformers' remote-code loader,
so it imports only the standard library, transformers and its sibling ``tokenization_esm``, and does
nothing at import time.

Vocabulary (8,229 ids; line number of ``vocab.txt`` = id), as the official ByProt code at bytedance/dplm
8b3425b uses it:

- 0-32: the ESM2 table with modality-specific specials: ``<cls_aa>`` 0, ``<pad>`` 1, ``<eos_aa>`` 2,
  ``<unk_aa>`` 3, the residues ``LAGVSERTIDPKQNFYMHWCXBUZO`` 4-28, ``.`` 29, ``-`` 30, ``<null_1>`` 31,
  ``<mask_aa>`` 32. Every id below 33 is the amino-acid track ("all amino acid token id < 33").
- 33-35: ``<cls_struct>``, ``<eos_struct>``, ``<unk_struct>``.
- 36-8227: the 8,192 structure codes ``"0000"``-``"8191"`` (4 digits, zero-padded; code c has id 36 + c,
  the offset the official bit model hard-codes).
- 8228: ``<mask_struct>``.

A packed row is ``[<cls_struct> s... <eos_struct> pad... | <cls_aa> a... <eos_aa> pad...]``: each track is
padded to its own longest in the batch and, since a protein has one structure token per residue, the two
halves have equal length. ``type_ids`` follow the official rule: 1 (amino acid) for ids < 33 that are not
``<pad>``, 0 (structure) for the others, structure specials included, and 2 for ``<pad>``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from transformers.tokenization_python import PythonBackend
from transformers.tokenization_utils_base import BatchEncoding

from .tokenization_esm import (
    DEFAULT_MODEL_MAX_LENGTH,
    ESM2_VOCAB,
    VOCAB_FILE_NAME,
    ESMTokenizer,
    write_tokenizer_files,
)

# ESM2 ids 4..31 (residues, ".", "-", "<null_1>") keep their ids; only the four specials and the mask are renamed.
AA_VOCAB: tuple[str, ...] = ("<cls_aa>", "<pad>", "<eos_aa>", "<unk_aa>", *ESM2_VOCAB[4:32], "<mask_aa>")
STRUCT_SPECIALS: tuple[str, ...] = ("<cls_struct>", "<eos_struct>", "<unk_struct>")
NUM_STRUCT_CODES = 8192
STRUCT_CODES: tuple[str, ...] = tuple(f"{code:04d}" for code in range(NUM_STRUCT_CODES))
DPLM2_VOCAB: tuple[str, ...] = (*AA_VOCAB, *STRUCT_SPECIALS, *STRUCT_CODES, "<mask_struct>")

AA_CLS_ID, PAD_ID, AA_EOS_ID, AA_UNK_ID = 0, 1, 2, 3
AA_MASK_ID = 32
AA_TRACK_SIZE = 33  # ids below this are the amino-acid track
STRUCT_CLS_ID, STRUCT_EOS_ID, STRUCT_UNK_ID = 33, 34, 35
STRUCT_CODE_OFFSET = 36  # id of code "0000"
STRUCT_MASK_ID = 8228
VOCAB_SIZE = 8229
# Modality type ids, as the official wrapper's get_modality_type assigns them.
STRUCT_TYPE, AA_TYPE, PAD_TYPE = 0, 1, 2

_SPECIAL_TOKENS: dict[str, str] = {
    "cls_token": "<cls_aa>",
    "pad_token": "<pad>",
    "eos_token": "<eos_aa>",
    "unk_token": "<unk_aa>",
    "mask_token": "<mask_aa>",
}
# Bracketed structure-track tokens a structure string may name (the track's cls/eos are added by encoding).
_STRUCT_NAMED: dict[str, int] = {
    "<cls_struct>": STRUCT_CLS_ID,
    "<eos_struct>": STRUCT_EOS_ID,
    "<unk_struct>": STRUCT_UNK_ID,
    "<mask_struct>": STRUCT_MASK_ID,
}
_DIGITS = frozenset("0123456789")


def _check_vocab(tokens: Sequence[str]) -> None:
    if tuple(tokens) != DPLM2_VOCAB:
        diff = next((i for i, (a, b) in enumerate(zip(tokens, DPLM2_VOCAB, strict=False)) if a != b), None)
        where = f"first difference at id {diff}" if diff is not None else "a length difference"
        raise ValueError(
            f"unrecognised DPLM2 vocabulary ({len(tokens)} tokens, {where}); expected exactly DPLM2_VOCAB "
            f"({VOCAB_SIZE} tokens)"
        )


def write_vocab(path: str | Path, vocab: Sequence[str] = DPLM2_VOCAB) -> Path:
    """Write ``vocab`` (it must be ``DPLM2_VOCAB``) one token per line (line number = id); return the path."""
    _check_vocab(vocab)
    path = Path(path)
    path.write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return path


def modality_type_ids(input_ids: Sequence[int]) -> list[int]:
    """The official type of each id: 1 amino acid (id < 33, not pad), 2 pad, 0 structure (the rest)."""
    return [PAD_TYPE if i == PAD_ID else AA_TYPE if i < AA_TRACK_SIZE else STRUCT_TYPE for i in input_ids]


def structure_ids(structure: str | Iterable[int]) -> list[int]:
    """Token ids of a structure track, without its ``<cls_struct>``/``<eos_struct>``.

    ``structure`` is either the official CLI's text form, comma-separated 4-digit codes such as
    ``"0012,8191,0003"`` (an element may also be a whole structure token such as ``<mask_struct>``), or
    the codes as integers 0..8191. No whitespace, empty elements or ``<unk>`` fallback: anything else is a
    ``ValueError`` that names the element and where it is.
    """
    if isinstance(structure, str):
        if not structure:
            raise ValueError("empty structure: a structure track needs at least one token")
        ids: list[int] = []
        offset = 0
        for index, element in enumerate(structure.split(",")):
            if element in _STRUCT_NAMED:
                ids.append(_STRUCT_NAMED[element])
            elif len(element) == 4 and set(element) <= _DIGITS:
                code = int(element)
                if code >= NUM_STRUCT_CODES:
                    raise ValueError(
                        f"structure code {element!r} (element {index}, character {offset}) is out of range: "
                        f"codes are 0000..{NUM_STRUCT_CODES - 1:04d}"
                    )
                ids.append(STRUCT_CODE_OFFSET + code)
            else:
                raise ValueError(
                    f"invalid structure element {element!r} (element {index}, character {offset}): expected a "
                    f"4-digit code 0000..{NUM_STRUCT_CODES - 1:04d} or a whole structure token such as "
                    "'<mask_struct>', separated by single commas"
                )
            offset += len(element) + 1
        return ids
    if isinstance(structure, (bytes, bytearray)):
        raise TypeError("structure must be a comma-separated string or a sequence of integer codes, not bytes")
    ids = []
    for index, value in enumerate(structure):
        if isinstance(value, bool) or isinstance(value, str):
            raise ValueError(f"structure code {value!r} at element {index} is not an integer code")
        try:
            code = operator.index(value)
        except TypeError:
            raise ValueError(f"structure code {value!r} at element {index} is not an integer code") from None
        if not 0 <= code < NUM_STRUCT_CODES:
            raise ValueError(
                f"structure code {code} at element {index} is out of range: codes are 0..{NUM_STRUCT_CODES - 1}"
            )
        ids.append(STRUCT_CODE_OFFSET + code)
    if not ids:
        raise ValueError("empty structure: a structure track needs at least one token")
    return ids


class DPLM2Tokenizer(ESMTokenizer):
    """DPLM2's tokenizer: ESM-style strict amino-acid tokenization plus a structure-code track.

    Calling it (``tokenizer(["MKT..."])``) tokenizes **amino-acid** text, one token per residue, as
    ``<cls_aa> residues <eos_aa>``; only amino-acid-track tokens (ids < 33) are accepted there, so a
    structure code or ``<mask_struct>`` in amino-acid text is an error. Structure tracks go through
    ``encode_structure`` (``<cls_struct> codes <eos_struct>``), and ``pack`` builds the packed two-track
    rows the model takes, with their ``type_ids``. The HF named specials are the amino-acid ones
    (``cls_token`` = ``<cls_aa>``, ``mask_token`` = ``<mask_aa>`` ...); the structure specials are the
    module constants ``STRUCT_*_ID``.

    Subclasses ``ESMTokenizer`` for its strict tokenize/convert/special-token machinery; only the
    vocabulary, the alphabet of the amino-acid track and the file writing differ.
    """

    vocab_files_names = {"vocab_file": VOCAB_FILE_NAME}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str | Path,
        cls_token: str = "<cls_aa>",
        pad_token: str = "<pad>",
        eos_token: str = "<eos_aa>",
        unk_token: str = "<unk_aa>",
        mask_token: str = "<mask_aa>",
        model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
        **kwargs: Any,
    ) -> None:
        # ESMTokenizer.__init__ accepts only the two 33-token ESM vocabularies, so set up the same state for
        # the DPLM2 vocabulary here and go straight to the PythonBackend initialiser (which calls get_vocab).
        self.vocab_file = vocab_file
        tokens = tuple(Path(vocab_file).read_text(encoding="utf-8").splitlines())
        _check_vocab(tokens)
        self._id_to_token: tuple[str, ...] = tokens
        self.vocab_name = "dplm2"
        self._token_to_id: dict[str, int] = {tok: i for i, tok in enumerate(tokens)}
        # Text is amino-acid text: single characters of the aa track are residues, its bracketed tokens may
        # appear whole; structure tokens are deliberately not in the trie.
        self._alphabet = "".join(tok for tok in AA_VOCAB if len(tok) == 1)
        self._multichar_vocab = frozenset(tok for tok in AA_VOCAB if len(tok) > 1)
        PythonBackend.__init__(
            self,
            cls_token=cls_token,
            pad_token=pad_token,
            eos_token=eos_token,
            unk_token=unk_token,
            mask_token=mask_token,
            model_max_length=model_max_length,
            **kwargs,
        )
        self._update_trie(sorted(self._multichar_vocab))

    def _tokenize(self, text: str, offset: int = 0, **kwargs: Any) -> list[str]:
        for i, char in enumerate(text):
            if char not in self._alphabet:
                rest = text[i:]
                hint = ""
                if char in _DIGITS or any(rest.startswith(name) for name in _STRUCT_NAMED):
                    hint = (
                        "; structure codes and structure tokens belong in the structure track "
                        "(encode_structure / pack), not in amino-acid text"
                    )
                raise ValueError(
                    f"invalid character {char!r} at position {offset + i} of an amino-acid sequence: expected "
                    f"one of {self._alphabet!r} or a whole amino-acid token such as '<mask_aa>'{hint}"
                )
        return list(text)

    # ------------------------------------------------------------------ structure track and packed rows

    def encode_structure(self, structure: str | Iterable[int], add_special_tokens: bool = True) -> list[int]:
        """Ids of one structure track: ``<cls_struct> codes <eos_struct>`` (see ``structure_ids``)."""
        ids = structure_ids(structure)
        return [STRUCT_CLS_ID, *ids, STRUCT_EOS_ID] if add_special_tokens else ids

    def decode_structure(self, ids: Iterable[int]) -> str:
        """The official text form of a structure track: codes joined by commas.

        ``<cls_struct>``, ``<eos_struct>`` and ``<pad>`` are dropped; ``<unk_struct>`` and ``<mask_struct>``
        are written by name; an amino-acid-track id is an error.
        """
        out: list[str] = []
        for position, raw in enumerate(ids):
            i = operator.index(raw)
            if i in (STRUCT_CLS_ID, STRUCT_EOS_ID, PAD_ID):
                continue
            if not AA_TRACK_SIZE <= i < VOCAB_SIZE:
                raise ValueError(f"token id {i} at position {position} is not a structure-track id (33..8228)")
            out.append(self._id_to_token[i])
        return ",".join(out)

    def _aa_ids(self, sequence: str, row: int) -> list[int]:
        if not isinstance(sequence, str):
            raise TypeError(f"row {row}: an amino-acid sequence must be a string, got {type(sequence).__name__}")
        try:
            return self.convert_tokens_to_ids(self.tokenize(sequence))
        except ValueError as error:
            raise ValueError(f"row {row} (amino-acid track): {error}") from None

    def pack(
        self,
        structures: Sequence[str | Iterable[int]] | None = None,
        sequences: Sequence[str] | None = None,
        *,
        return_tensors: str | None = None,
    ) -> BatchEncoding:
        """A batch of model rows, with ``input_ids``, ``attention_mask`` (ids != pad) and ``type_ids``.

        With both tracks: packed rows ``[<cls_struct> s... <eos_struct> pad... | <cls_aa> a... <eos_aa>
        pad...]``, each track padded to its own longest; row i needs as many structure tokens as residues
        (one per residue), so both halves have the same width. With one track (the other ``None``): that
        track alone, right-padded (a single-modality batch). No truncation.
        """
        if structures is None and sequences is None:
            raise ValueError("pack needs structures, sequences or both")
        if isinstance(structures, str) or isinstance(sequences, str):
            raise TypeError("pack takes lists of rows; wrap a single structure or sequence in a list")
        rows = len(structures) if structures is not None else len(sequences)  # type: ignore[arg-type]
        if structures is not None and sequences is not None and len(sequences) != rows:
            raise ValueError(f"pack got {rows} structures but {len(sequences)} sequences")
        if rows == 0:
            raise ValueError("pack needs at least one row")
        struct_rows: list[list[int]] = []
        aa_rows: list[list[int]] = []
        for row in range(rows):
            if structures is not None:
                try:
                    struct_rows.append(structure_ids(structures[row]))
                except ValueError as error:
                    raise ValueError(f"row {row} (structure track): {error}") from None
            if sequences is not None:
                aa_rows.append(self._aa_ids(sequences[row], row))
            if structures is not None and sequences is not None and len(struct_rows[-1]) != len(aa_rows[-1]):
                raise ValueError(
                    f"row {row}: the structure track has {len(struct_rows[-1])} tokens and the amino-acid track "
                    f"{len(aa_rows[-1])}; a packed row needs one structure token per residue"
                )
        tracks = []
        if structures is not None:
            tracks.append(_padded([[STRUCT_CLS_ID, *ids, STRUCT_EOS_ID] for ids in struct_rows]))
        if sequences is not None:
            tracks.append(_padded([[AA_CLS_ID, *ids, AA_EOS_ID] for ids in aa_rows]))
        input_ids = [sum((track[row] for track in tracks), []) for row in range(rows)]
        data = {
            "input_ids": input_ids,
            "attention_mask": [[int(i != PAD_ID) for i in ids] for ids in input_ids],
            "type_ids": [modality_type_ids(ids) for ids in input_ids],
        }
        return BatchEncoding(data, tensor_type=return_tensors)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        name = f"{filename_prefix}-{VOCAB_FILE_NAME}" if filename_prefix else VOCAB_FILE_NAME
        path = write_vocab(Path(save_directory) / name, self._id_to_token)
        return (str(path),)


def _padded(rows: list[list[int]]) -> list[list[int]]:
    width = max(len(ids) for ids in rows)
    return [ids + [PAD_ID] * (width - len(ids)) for ids in rows]


def tokenizer_files(
    directory: str | Path, vocab: Sequence[str] = DPLM2_VOCAB, model_max_length: int = DEFAULT_MODEL_MAX_LENGTH
) -> list[Path]:
    """Write the tokenizer files of a remote-code artifact; the caller copies this module (and
    ``tokenization_esm.py``, which it imports) beside them."""
    return write_tokenizer_files(
        directory,
        vocab,
        model_max_length,
        tokenizer_class=DPLM2Tokenizer,
        module="tokenization_dplm2",
        special_tokens=_SPECIAL_TOKENS,
        vocab_writer=write_vocab,
    )
