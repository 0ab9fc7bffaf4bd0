"""Tests for the strict DPLM2 tokenizer: vocabulary, amino-acid and structure tracks, packed rows, files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fastplms.tokenization_dplm2 as tokenization_dplm2
import fastplms.tokenization_esm as tokenization_esm
from fastplms.tokenization_dplm2 import (
    AA_CLS_ID,
    AA_EOS_ID,
    AA_MASK_ID,
    AA_TYPE,
    AA_UNK_ID,
    AA_VOCAB,
    DPLM2_VOCAB,
    PAD_ID,
    PAD_TYPE,
    STRUCT_CLS_ID,
    STRUCT_CODE_OFFSET,
    STRUCT_EOS_ID,
    STRUCT_MASK_ID,
    STRUCT_TYPE,
    STRUCT_UNK_ID,
    VOCAB_SIZE,
    DPLM2Tokenizer,
    modality_type_ids,
    structure_ids,
    tokenizer_files,
    write_vocab,
)
from fastplms.tokenization_esm import ESM2_VOCAB

M, K, T, A, C = (DPLM2_VOCAB.index(c) for c in "MKTAC")


def code(c: int) -> int:
    return STRUCT_CODE_OFFSET + c


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> DPLM2Tokenizer:
    return DPLM2Tokenizer(str(write_vocab(tmp_path_factory.mktemp("dplm2") / "vocab.txt")))


def test_vocab_table() -> None:
    assert len(DPLM2_VOCAB) == VOCAB_SIZE == 8229 == 33 + 8192 + 4  # the official TokenizerConfig.vocab_size
    assert len(set(DPLM2_VOCAB)) == VOCAB_SIZE
    assert DPLM2_VOCAB[:4] == ("<cls_aa>", "<pad>", "<eos_aa>", "<unk_aa>")
    assert DPLM2_VOCAB[4:32] == ESM2_VOCAB[4:32]  # residues, ".", "-", "<null_1>" keep their ESM ids
    assert "".join(DPLM2_VOCAB[4:29]) == "LAGVSERTIDPKQNFYMHWCXBUZO"
    assert DPLM2_VOCAB[32] == "<mask_aa>" and AA_VOCAB == DPLM2_VOCAB[:33]
    assert DPLM2_VOCAB[33:36] == ("<cls_struct>", "<eos_struct>", "<unk_struct>")
    assert DPLM2_VOCAB[36] == "0000" and DPLM2_VOCAB[8227] == "8191" and DPLM2_VOCAB[8228] == "<mask_struct>"
    assert all(DPLM2_VOCAB[code(c)] == f"{c:04d}" for c in range(8192))
    # generate_dplm2.py fills co-generation structure tracks with tokenizer.all_tokens[50]: code 14.
    assert DPLM2_VOCAB[50] == "0014"
    ids = (AA_CLS_ID, PAD_ID, AA_EOS_ID, AA_UNK_ID, AA_MASK_ID, STRUCT_CLS_ID, STRUCT_EOS_ID, STRUCT_UNK_ID)
    assert [DPLM2_VOCAB[i] for i in ids] == [
        "<cls_aa>", "<pad>", "<eos_aa>", "<unk_aa>", "<mask_aa>", "<cls_struct>", "<eos_struct>", "<unk_struct>",
    ]  # fmt: skip
    assert DPLM2_VOCAB[STRUCT_MASK_ID] == "<mask_struct>"


def test_vocab_file_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unrecognised DPLM2 vocabulary"):
        write_vocab(tmp_path / "bad.txt", ESM2_VOCAB)
    path = tmp_path / "swapped.txt"
    path.write_text("\n".join(DPLM2_VOCAB[:40] + DPLM2_VOCAB[41:40:-1] + DPLM2_VOCAB[40:41] + DPLM2_VOCAB[42:]))
    with pytest.raises(ValueError, match="first difference at id 40"):
        DPLM2Tokenizer(str(path))
    esm = tmp_path / "esm2.txt"
    esm.write_text("\n".join(ESM2_VOCAB) + "\n")
    with pytest.raises(ValueError, match="unrecognised DPLM2 vocabulary"):
        DPLM2Tokenizer(str(esm))


def test_tokenizer_basics(tok: DPLM2Tokenizer) -> None:
    assert len(tok) == tok.vocab_size == VOCAB_SIZE
    assert tok.get_vocab() == {t: i for i, t in enumerate(DPLM2_VOCAB)}
    assert (tok.cls_token_id, tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, tok.mask_token_id) == (
        AA_CLS_ID,
        PAD_ID,
        AA_EOS_ID,
        AA_UNK_ID,
        AA_MASK_ID,
    )
    assert isinstance(tok, tokenization_esm.ESMTokenizer) and tok.vocab_name == "dplm2"


def test_amino_acid_track(tok: DPLM2Tokenizer) -> None:
    assert tok("MKTA")["input_ids"] == [AA_CLS_ID, M, K, T, A, AA_EOS_ID]
    batch = tok(["MKT", "M<mask_aa>K<null_1>.-"], padding=True)
    assert batch["input_ids"] == [[0, M, K, T, 2, 1, 1, 1], [0, M, 32, K, 31, 29, 30, 2]]
    assert batch["attention_mask"] == [[1] * 5 + [0] * 3, [1] * 8]
    assert tok.decode(batch["input_ids"][1], skip_special_tokens=True) == "MK<null_1>.-"
    out = tok(["MKTA"], return_tensors="pt")
    assert out["input_ids"].dtype == torch.int64 and out["input_ids"].shape == (1, 6)


@pytest.mark.parametrize(
    ("text", "char", "position", "structure_hint"),
    [
        ("MKJ", "J", 2, False),
        ("mkt", "m", 0, False),
        ("MK T", " ", 2, False),
        ("MK<mask>", "<", 2, False),  # the generic ESM mask does not exist in DPLM2
        ("MK<mask_struct>A", "<", 2, True),
        ("A0012", "0", 1, True),
        ("<cls_struct>MK", "<", 0, True),
    ],
)
def test_amino_acid_errors(tok: DPLM2Tokenizer, text: str, char: str, position: int, structure_hint: bool) -> None:
    with pytest.raises(ValueError, match=f"invalid character {char!r} at position {position} ") as info:
        tok(text)
    assert ("belong in the structure track" in str(info.value)) == structure_hint


def test_empty_amino_acid_sequence(tok: DPLM2Tokenizer) -> None:
    with pytest.raises(ValueError, match="empty sequence"):
        tok("")


def test_structure_track(tok: DPLM2Tokenizer) -> None:
    expected = [STRUCT_CLS_ID, code(12), code(8191), code(3), STRUCT_EOS_ID]
    assert tok.encode_structure("0012,8191,0003") == expected
    assert tok.encode_structure([12, 8191, 3]) == expected
    assert tok.encode_structure(torch.tensor([12, 8191, 3])) == expected
    assert tok.encode_structure("0000,<mask_struct>,<unk_struct>", add_special_tokens=False) == [
        code(0),
        STRUCT_MASK_ID,
        STRUCT_UNK_ID,
    ]
    assert structure_ids("0014") == [50]
    assert tok.decode_structure(expected + [PAD_ID]) == "0012,8191,0003"
    assert tok.decode_structure([STRUCT_CLS_ID, STRUCT_MASK_ID, code(7), STRUCT_EOS_ID]) == "<mask_struct>,0007"
    with pytest.raises(ValueError, match="token id 5 at position 1 is not a structure-track id"):
        tok.decode_structure([STRUCT_CLS_ID, 5])


@pytest.mark.parametrize(
    ("structure", "message"),
    [
        ("", "empty structure"),
        ([], "empty structure"),
        ("0012,8192", r"structure code '8192' \(element 1, character 5\) is out of range"),
        ("12", r"invalid structure element '12' \(element 0, character 0\)"),
        ("00120003", r"invalid structure element '00120003' \(element 0"),
        ("0012,,0003", r"invalid structure element '' \(element 1, character 5\)"),
        ("0012, 0003", r"invalid structure element ' 0003' \(element 1, character 5\)"),
        ("0012,0003,", r"invalid structure element '' \(element 2, character 10\)"),
        ("0012,abcd", r"invalid structure element 'abcd' \(element 1"),
        ("0012,<mask_aa>", r"invalid structure element '<mask_aa>' \(element 1"),
        ("-001", r"invalid structure element '-001'"),
        ([1, 8192], "structure code 8192 at element 1 is out of range"),
        ([1, -1], "structure code -1 at element 1 is out of range"),
        ([1, True], "structure code True at element 1 is not an integer code"),
        ([1, 2.0], "structure code 2.0 at element 1 is not an integer code"),
        ([1, "0002"], "structure code '0002' at element 1 is not an integer code"),
    ],
)
def test_structure_errors(tok: DPLM2Tokenizer, structure, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tok.encode_structure(structure)


def test_structure_bytes_rejected(tok: DPLM2Tokenizer) -> None:
    with pytest.raises(TypeError, match="not bytes"):
        tok.encode_structure(b"0012")


def test_modality_type_ids_rule() -> None:
    ids = list(range(VOCAB_SIZE))
    types = modality_type_ids(ids)
    assert types[PAD_ID] == PAD_TYPE
    assert all(t == AA_TYPE for i, t in enumerate(types[:33]) if i != PAD_ID)
    assert set(types[33:]) == {STRUCT_TYPE}  # struct specials included


def test_pack_layout(tok: DPLM2Tokenizer) -> None:
    out = tok.pack(["0012,8191,<mask_struct>", "0001"], ["MK<mask_aa>", "C"])
    s_row0 = [STRUCT_CLS_ID, code(12), code(8191), STRUCT_MASK_ID, STRUCT_EOS_ID]
    a_row0 = [AA_CLS_ID, M, K, AA_MASK_ID, AA_EOS_ID]
    s_row1 = [STRUCT_CLS_ID, code(1), STRUCT_EOS_ID, PAD_ID, PAD_ID]
    a_row1 = [AA_CLS_ID, C, AA_EOS_ID, PAD_ID, PAD_ID]
    assert out["input_ids"] == [s_row0 + a_row0, s_row1 + a_row1]
    assert out["attention_mask"] == [[1] * 10, [1, 1, 1, 0, 0, 1, 1, 1, 0, 0]]
    assert out["type_ids"] == [[0] * 5 + [1] * 5, [0, 0, 0, 2, 2, 1, 1, 1, 2, 2]]
    pt = tok.pack(["0012,8191,<mask_struct>", "0001"], ["MK<mask_aa>", "C"], return_tensors="pt")
    assert pt["input_ids"].tolist() == out["input_ids"] and pt["type_ids"].dtype == torch.int64
    # Both halves have equal width, so the official chunk(2) split separates the tracks exactly.
    struct_half, aa_half = pt["input_ids"].chunk(2, dim=1)
    assert struct_half[:, 0].eq(STRUCT_CLS_ID).all() and aa_half[:, 0].eq(AA_CLS_ID).all()
    assert tok.pack([[12, 8191, 3]], ["MKT"])["input_ids"] == tok.pack(["0012,8191,0003"], ["MKT"])["input_ids"]


def test_pack_single_track(tok: DPLM2Tokenizer) -> None:
    aa = tok.pack(sequences=["MKT", "A"])
    assert aa["input_ids"] == tok(["MKT", "A"], padding=True)["input_ids"]
    assert aa["type_ids"] == [[1] * 5, [1, 1, 1, 2, 2]]
    struct = tok.pack(structures=["0001,0002", "<mask_struct>"])
    assert struct["input_ids"] == [[33, code(1), code(2), 34], [33, STRUCT_MASK_ID, 34, PAD_ID]]
    assert struct["type_ids"] == [[0] * 4, [0, 0, 0, 2]]


def test_pack_errors(tok: DPLM2Tokenizer) -> None:
    with pytest.raises(ValueError, match="row 1: the structure track has 2 tokens and the amino-acid track 3"):
        tok.pack(["0001", "0001,0002"], ["M", "MKT"])
    with pytest.raises(ValueError, match=r"row 1 \(amino-acid track\): invalid character 'J' at position 1"):
        tok.pack(["0001", "0001,0002"], ["M", "MJ"])
    with pytest.raises(ValueError, match=r"row 0 \(structure track\): structure code '9999'"):
        tok.pack(["9999"], ["M"])
    with pytest.raises(ValueError, match="pack got 2 structures but 1 sequences"):
        tok.pack(["0001", "0002"], ["M"])
    with pytest.raises(ValueError, match="at least one row"):
        tok.pack([], [])
    with pytest.raises(ValueError, match="needs structures, sequences or both"):
        tok.pack()
    with pytest.raises(TypeError, match="lists of rows"):
        tok.pack("0001", "M")
    with pytest.raises(ValueError, match=r"row 0 \(amino-acid track\): empty sequence"):
        tok.pack(sequences=[""])


def test_save_and_files(tok: DPLM2Tokenizer, tmp_path: Path) -> None:
    tok.save_pretrained(tmp_path / "saved")
    again = DPLM2Tokenizer.from_pretrained(str(tmp_path / "saved"))
    assert again("MK<mask_aa>")["input_ids"] == tok("MK<mask_aa>")["input_ids"]
    assert (tmp_path / "saved" / "vocab.txt").read_text().splitlines() == list(DPLM2_VOCAB)
    paths = tokenizer_files(tmp_path / "art")
    assert sorted(p.name for p in paths) == ["special_tokens_map.json", "tokenizer_config.json", "vocab.txt"]
    config = json.loads((tmp_path / "art" / "tokenizer_config.json").read_text())
    assert config["auto_map"] == {"AutoTokenizer": ["tokenization_dplm2.DPLM2Tokenizer", None]}
    assert config["tokenizer_class"] == "DPLM2Tokenizer" and config["model_max_length"] == 1026
    special = json.loads((tmp_path / "art" / "special_tokens_map.json").read_text())
    assert special == {k: config[k] for k in special} and special["mask_token"] == "<mask_aa>"
    loaded = DPLM2Tokenizer.from_pretrained(str(tmp_path / "art"))
    assert loaded.pack(["0001"], ["M"])["input_ids"] == [[33, code(1), 34, 0, M, 2]]


_LOAD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sys.argv[2], trust_remote_code=True)
    result = {
        "class": type(tok).__name__,
        "module": type(tok).__module__,
        "aa": tok(["MKT", "M<mask_aa>"], padding=True)["input_ids"],
        "pack": tok.pack(["0012,<mask_struct>"], ["MK"])["input_ids"],
        "type_ids": tok.pack(["0012,<mask_struct>"], ["MK"])["type_ids"],
    }
    try:
        tok("MK0012")
    except ValueError as exc:
        result["error"] = str(exc)
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
    """
)


def test_remote_code_round_trip(tmp_path: Path) -> None:
    """The artifact layout: this module and tokenization_esm.py (its sibling import) beside the files."""
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    shutil.copy(tokenization_dplm2.__file__, artifact / "tokenization_dplm2.py")
    shutil.copy(tokenization_esm.__file__, artifact / "tokenization_esm.py")
    tokenizer_files(artifact)
    script = tmp_path / "load.py"
    script.write_text(_LOAD_SCRIPT)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "m")}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out.json"), str(artifact)],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["class"] == "DPLM2Tokenizer" and result["module"].startswith("transformers_modules.")
    assert result["aa"] == [[0, M, K, T, 2], [0, M, 32, 2, 1]]
    assert result["pack"] == [[33, code(12), STRUCT_MASK_ID, 34, 0, M, K, 2]]
    assert result["type_ids"] == [[0, 0, 0, 0, 1, 1, 1, 1]]
    assert "structure track" in result["error"]
