"""Tests for the strict ANKH tokenizer: official ids on official-format files, padding, errors, decode, ANKH3 task
prefixes, the artifact's tokenizer files and the AutoTokenizer remote-code round trip."""

from __future__ import annotations

import json
import logging
import re
import shutil
import warnings
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from fresh_process import run_fresh
from tokenizers import Tokenizer
from transformers import AutoTokenizer, T5TokenizerFast

import fastplms.tokenization_ankh as tokenization_ankh
from fastplms.artifact.build import runtime_closure
from fastplms.oracles import ankh as oracle
from fastplms.tokenization_ankh import (
    EOS_ID,
    PAD_ID,
    UNK_ID,
    ANKHTokenizer,
    read_spiece,
    spiece_tokenizer_json,
    tokenizer_files,
)

REFERENCE = "MCADPSKCIYMYV"  # families.md §4.3
V1_REFERENCE = [19, 22, 3, 10, 13, 7, 14, 22, 12, 18, 19, 18, 6]
V3_REFERENCE = [24, 25, 8, 16, 17, 10, 18, 25, 15, 22, 24, 22, 11]
V1_IDS = {"A": 3, "V": 6, "S": 7, "D": 10, "I": 12, "P": 13, "K": 14, "Y": 18, "M": 19, "C": 22}
V3_IDS = {"A": 8, "S": 10, "V": 11, "I": 15, "D": 16, "P": 17, "K": 18, "Y": 22, "M": 24, "C": 25}
NLU, S2S = 3, 4  # reconstructed ANKH3 ids
V1_SENTINEL0, V3_SENTINEL0 = 143, 255

# Measured once with the official ANKH stack (transformers 4.25.1, tokenizers 0.13.3, sentencepiece 0.1.99) on
# the files the oracle writes: AutoTokenizer (T5TokenizerFast) on the v1 snapshot folders, the slow
# T5Tokenizer("spiece.model") for ANKH3; REFERENCE unless stated.
OFFICIAL_4_25_MEASURED = {
    "v1 raw": [*V1_REFERENCE, 1],
    "v1 is_split_into_words": [*V1_REFERENCE, 1],
    "v1 metaspace raw": [UNK_ID, *V1_REFERENCE, 1],
    "v1 metaspace is_split_into_words": [x for r in V1_REFERENCE for x in (UNK_ID, r)] + [1],
    "v3 slow raw": [*V3_REFERENCE, 1],
    "v3 slow is_split_into_words": [*V3_REFERENCE, 1],
    "v3 slow [NLU] + raw": [NLU, *V3_REFERENCE, 1],
    "v3 slow [S2S] + raw": [S2S, *V3_REFERENCE, 1],
    "v3 slow ['[NLU]', *list(seq)]": [NLU, *V3_REFERENCE, 1],
    "v3 slow 'MC<extra_id_0>AD'": [24, 25, V3_SENTINEL0, 8, 16, 1],
    "v3 fast raw": [*V3_REFERENCE, 1],
}


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ankh_snapshots")
    return {
        "v1": oracle.write_ankh_tokenizer_snapshot(root / "v1", "v1"),
        "v1m": oracle.write_ankh_tokenizer_snapshot(root / "v1m", "v1", pre_tokenizer="metaspace"),
        "v3": oracle.write_ankh_tokenizer_snapshot(root / "v3", "v3"),
    }


@pytest.fixture(scope="module")
def artifacts(snapshots: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ankh_artifacts")
    out = {}
    for name, snapshot in snapshots.items():
        out[name] = root / name
        tokenizer_files(out[name], snapshot)
        shutil.copy(tokenization_ankh.__file__, out[name] / "tokenization_ankh.py")
    return out


@pytest.fixture(scope="module")
def v1(artifacts: dict[str, Path]) -> ANKHTokenizer:
    return ANKHTokenizer.from_pretrained(str(artifacts["v1"]))


@pytest.fixture(scope="module")
def v3(artifacts: dict[str, Path]) -> ANKHTokenizer:
    return ANKHTokenizer.from_pretrained(str(artifacts["v3"]))


# --- the oracle files ------------------------------------------------------------------------------------------


def test_oracle_v1_file_layout(snapshots: dict[str, Path]) -> None:
    backend = Tokenizer.from_file(str(snapshots["v1"] / "tokenizer.json"))
    vocab = backend.get_vocab()
    assert backend.get_vocab_size() == oracle.ANKH_V1_SIZE == 144
    assert (vocab["<pad>"], vocab["</s>"], vocab["<unk>"]) == (0, 1, 2)
    assert {r: vocab[r] for r in V1_IDS} == V1_IDS
    assert [vocab[r] for r in oracle.ANKH_V1_CANONICAL] == list(range(3, 23))
    assert vocab["<extra_id_0>"] == V1_SENTINEL0 and vocab["<extra_id_99>"] == 44
    assert "▁" not in vocab  # Transformers 5's rebuilt Metaspace therefore yields <unk>, not a ▁ id
    data = json.loads((snapshots["v1"] / "tokenizer.json").read_text())
    assert data["model"]["type"] == "Unigram" and data["pre_tokenizer"] == {"type": "WhitespaceSplit"}
    assert data["post_processor"]["type"] == "TemplateProcessing"
    metaspace = json.loads((snapshots["v1m"] / "tokenizer.json").read_text())["pre_tokenizer"]
    assert metaspace == {"type": "Metaspace", "replacement": "▁", "add_prefix_space": True}


def test_oracle_v3_spiece_layout(snapshots: dict[str, Path]) -> None:
    sp = spm.SentencePieceProcessor()
    sp.Load(str(snapshots["v3"] / "spiece.model"))
    assert sp.GetPieceSize() == 156 == oracle.ANKH3_SIZE - oracle.NUM_SENTINELS
    assert {r: sp.PieceToId(r) for r in V3_IDS} == V3_IDS
    assert [sp.PieceToId(r) for r in oracle.ANKH3_CANONICAL] == list(range(7, 27))
    assert (sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id()) == (0, 1, 2, -1)
    assert sp.IsControl(0) and sp.IsControl(1) and sp.IsUnknown(2)
    assert [sp.IdToPiece(i) for i in (NLU, S2S)] == ["[NLU]", "[S2S]"]
    assert sp.Encode("[NLU]MC", out_type=str) == ["[NLU]", "M", "C"]  # user-defined: whole, no dummy prefix
    assert all(sp.Encode(r) == [sp.PieceToId(r)] for r in oracle.ANKH3_CANONICAL)


def test_read_spiece_equals_sentencepiece(snapshots: dict[str, Path]) -> None:
    path = snapshots["v3"] / "spiece.model"
    pieces, settings = read_spiece(path.read_bytes())
    sp = spm.SentencePieceProcessor()
    sp.Load(str(path))
    assert [p for p, _, _ in pieces] == [sp.IdToPiece(i) for i in range(sp.GetPieceSize())]
    assert [s for _, s, _ in pieces] == [sp.GetScore(i) for i in range(sp.GetPieceSize())]
    kinds = {i: k for i, (_, _, k) in enumerate(pieces)}
    assert [i for i, k in kinds.items() if k == 3] == [i for i in range(sp.GetPieceSize()) if sp.IsControl(i)]
    assert [i for i, k in kinds.items() if k == 4] == [NLU, S2S]
    assert [i for i, k in kinds.items() if k == 5] == [i for i in range(sp.GetPieceSize()) if sp.IsUnused(i)]
    assert settings == {"model_type": 1, "add_dummy_prefix": False}
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        read_spiece(b"\x0a\xff")


def test_spiece_conversion_equals_the_snapshot_fast_file(snapshots: dict[str, Path]) -> None:
    converted = Tokenizer.from_str(json.dumps(spiece_tokenizer_json(snapshots["v3"] / "spiece.model")))
    official = Tokenizer.from_file(str(snapshots["v3"] / "tokenizer.json"))
    assert converted.get_vocab() == official.get_vocab() and len(converted.get_vocab()) == oracle.ANKH3_SIZE


# --- official ids ----------------------------------------------------------------------------------------------


def test_reference_rows(v1: ANKHTokenizer, v3: ANKHTokenizer) -> None:
    assert v1(REFERENCE)["input_ids"] == [*V1_REFERENCE, EOS_ID]
    assert v3(REFERENCE)["input_ids"] == [*V3_REFERENCE, EOS_ID]
    for name, tok in (("v1", v1), ("v3", v3)):
        assert [tuple(r) for r in tok(list(oracle.GOLDEN_SEQUENCES))["input_ids"]] == list(oracle.GOLDEN_ROWS[name])
    assert v1.vocab_size == len(v1) == 144 and v3.vocab_size == len(v3) == 256
    assert (v1.pad_token_id, v1.eos_token_id, v1.unk_token_id) == (PAD_ID, EOS_ID, UNK_ID) == (0, 1, 2)
    assert v1.residues == v3.residues == "ABCDEFGHIKLMNOPQRSTUVWXYZ"


@pytest.mark.parametrize("name", ["v1", "v1m"])
def test_equals_official_fast_v1(name: str, snapshots: dict[str, Path], artifacts: dict[str, Path]) -> None:
    """Ours vs the snapshot file's own pipeline (transformers 4.25.1's T5TokenizerFast runs it as written)."""
    tok = ANKHTokenizer.from_pretrained(str(artifacts[name]))
    path = snapshots[name] / "tokenizer.json"
    sequences = list(oracle.GOLDEN_SEQUENCES)
    ours = tok([list(s) for s in sequences], is_split_into_words=True)["input_ids"]
    assert ours == tok(sequences)["input_ids"]
    split = oracle.official_fast_ids(path, sequences)
    raw = oracle.official_fast_ids(path, sequences, is_split_into_words=False)
    if name == "v1":  # the reconstruction consistent with the goldens: no artefact at all
        assert split == raw == ours
    else:  # T5-converter Metaspace: <unk> before every word; raw strings: one leading <unk>
        assert split == [[x for r in row[:-1] for x in (UNK_ID, r)] + [EOS_ID] for row in ours]
        assert raw == [[UNK_ID, *row] for row in ours]
    assert OFFICIAL_4_25_MEASURED[f"{'v1' if name == 'v1' else 'v1 metaspace'} raw"] == raw[2]
    assert OFFICIAL_4_25_MEASURED[f"{'v1' if name == 'v1' else 'v1 metaspace'} is_split_into_words"] == split[2]


@pytest.mark.parametrize("name", ["v1", "v1m", "v3"])
def test_transformers_5_autotokenizer_artefacts(name: str, snapshots: dict[str, Path]) -> None:
    """Transformers 5.13's AutoTokenizer / T5TokenizerFast on an official snapshot: its T5Tokenizer rebuilds
    WhitespaceSplit + Metaspace(always) whatever the file says, so each word gets a ▁ piece (<unk> where the
    vocabulary has no ▁). Removing exactly those gives our ids."""
    official = AutoTokenizer.from_pretrained(str(snapshots[name]))
    assert isinstance(official, T5TokenizerFast) and type(official).__name__ == "T5Tokenizer"
    artefact = UNK_ID if name != "v3" else official.convert_tokens_to_ids("▁")  # ANKH3 reconstruction has ▁ (5)
    ours = [*(V3_REFERENCE if name == "v3" else V1_REFERENCE), EOS_ID]
    raw = official(REFERENCE)["input_ids"]
    split = official(list(REFERENCE), is_split_into_words=True)["input_ids"]
    assert raw == [artefact, *ours]
    assert split == [x for r in ours[:-1] for x in (artefact, r)] + [EOS_ID]


def test_equals_official_slow_v3(v3: ANKHTokenizer, snapshots: dict[str, Path]) -> None:
    spiece = snapshots["v3"] / "spiece.model"
    for sequence in (*oracle.GOLDEN_SEQUENCES, "XBZUO", "M<extra_id_0>K<extra_id_7>"):
        split = oracle.official_slow_t5_ids(spiece, sequence) if "<" not in sequence else None
        raw = oracle.official_slow_t5_ids(spiece, sequence, is_split_into_words=False)
        assert v3(sequence)["input_ids"] == raw
        if split is not None:
            assert v3(list(sequence), is_split_into_words=True)["input_ids"] == split == raw
    for prefix in ("[NLU]", "[S2S]"):  # likelihood.py: tokenizer(prefix + sequence)
        raw = oracle.official_slow_t5_ids(spiece, REFERENCE, is_split_into_words=False, prefix=prefix)
        assert v3(REFERENCE, task_prefix=prefix)["input_ids"] == raw
        assert oracle.official_slow_t5_ids(spiece, REFERENCE, prefix=prefix) == raw
    measured = OFFICIAL_4_25_MEASURED
    assert oracle.official_slow_t5_ids(spiece, REFERENCE, is_split_into_words=False) == measured["v3 slow raw"]
    assert oracle.official_slow_t5_ids(spiece, REFERENCE) == measured["v3 slow is_split_into_words"]
    assert v3(REFERENCE, task_prefix="[NLU]")["input_ids"] == measured["v3 slow [NLU] + raw"]
    assert v3(REFERENCE, task_prefix="[S2S]")["input_ids"] == measured["v3 slow [S2S] + raw"]
    assert v3(["[NLU]", *REFERENCE], is_split_into_words=True)["input_ids"] == measured["v3 slow ['[NLU]', *list(seq)]"]
    assert v3("MC<extra_id_0>AD")["input_ids"] == measured["v3 slow 'MC<extra_id_0>AD'"]
    fast = oracle.official_fast_ids(snapshots["v3"] / "tokenizer.json", [REFERENCE], is_split_into_words=False)
    assert fast == [measured["v3 fast raw"]]


def test_official_file_loaded_directly(snapshots: dict[str, Path]) -> None:
    """The snapshot's own tokenizer.json works too: ANKHTokenizer installs its pipeline whatever the file says."""
    for name in ("v1", "v1m"):
        tok = ANKHTokenizer(tokenizer_file=str(snapshots[name] / "tokenizer.json"))
        assert tok(REFERENCE)["input_ids"] == [*V1_REFERENCE, EOS_ID]
        assert tok.decode(tok(REFERENCE)["input_ids"], skip_special_tokens=True) == REFERENCE


# --- batches, errors, decode -----------------------------------------------------------------------------------


def test_batches_and_padding(v1: ANKHTokenizer) -> None:
    batch = v1(["MKT", "MCADP"], padding=True)
    assert batch["input_ids"] == [[19, 14, 11, 1, 0, 0], [19, 22, 3, 10, 13, 1]]
    assert batch["attention_mask"] == [[1, 1, 1, 1, 0, 0], [1] * 6]
    assert set(batch) == {"input_ids", "attention_mask"}
    pt = v1(list(oracle.GOLDEN_SEQUENCES), padding=True, return_tensors="pt")
    assert pt["input_ids"].dtype == torch.int64 and pt["input_ids"].shape == (3, 62)
    assert pt["attention_mask"].sum(1).tolist() == [62, 30, 14]
    assert pt["input_ids"][2, 14:].eq(PAD_ID).all() and pt["input_ids"][2, 13] == EOS_ID
    rows = [list(row) + [0] * (62 - len(row)) for row in oracle.GOLDEN_ROWS["v1"]]
    assert pt["input_ids"].tolist() == rows  # the golden tensor, right-padded with 0
    split = v1([list(s) for s in oracle.GOLDEN_SEQUENCES], is_split_into_words=True, padding=True, return_tensors="pt")
    assert torch.equal(split["input_ids"], pt["input_ids"])
    assert v1(["MK"], padding="max_length", max_length=5)["input_ids"] == [[19, 14, 1, 0, 0]]
    assert v1("MKTAYV", truncation=True, max_length=4)["input_ids"] == [19, 14, 11, 1]  # </s> kept
    assert v1(["MKT"], padding=True, pad_to_multiple_of=8)["input_ids"] == [[19, 14, 11, 1, 0, 0, 0, 0]]
    assert v1.encode("MK") == [19, 14, 1] and v1.tokenize("MKW") == ["M", "K", "W"]
    assert v1("MK", return_special_tokens_mask=True)["special_tokens_mask"] == [0, 0, 1]
    pair = v1("MK", "AC")
    assert pair["input_ids"] == [19, 14, 1, 3, 22, 1]  # T5's pair layout, $A </s> $B </s>
    padded = v1.pad({"input_ids": [[19, 1], [19, 14, 11, 1]]})
    assert padded["input_ids"] == [[19, 1, 0, 0], [19, 14, 11, 1]]


@pytest.mark.parametrize(
    ("text", "char", "position"),
    [("MKJ", "J", 2), ("mkt", "m", 0), ("MK T", " ", 2), ("MK<mask>", "<", 2), ("M▁K", "▁", 1), ("MK\n", "\n", 2)],
)
def test_invalid_characters(v1: ANKHTokenizer, text: str, char: str, position: int) -> None:
    message = f"invalid character {char!r} at position {position}: expected one of"
    with pytest.raises(ValueError, match=re.escape(message)):
        v1(text)


def test_error_locations(v1: ANKHTokenizer, v3: ANKHTokenizer) -> None:
    with pytest.raises(ValueError, match="invalid character 'J' at position 1 of batch item 1:"):
        v1(["MKT", "MJ"], padding=True)
    with pytest.raises(ValueError, match="invalid character 'J' at position 3:"):
        v1(list("MKTJ"), is_split_into_words=True)
    with pytest.raises(ValueError, match="invalid character 'J' at position 2 of batch item 0:"):
        v1([list("MKJ")], is_split_into_words=True)
    with pytest.raises(ValueError, match="invalid character 'J' at position 0 of text_pair"):
        v1("MK", "J")
    with pytest.raises(ValueError, match=r"invalid character '\[' at position 0:"):
        v1("[NLU]MK")  # v1 has no task prefixes
    with pytest.raises(ValueError, match="invalid character '<' at position 1:"):
        v3("M<extra_id_0>", split_special_tokens=True)
    with pytest.raises(ValueError, match="empty sequence"):
        v1("")
    with pytest.raises(ValueError, match="empty sequence of batch item 1"):
        v1(["MK", ""])
    with pytest.raises(ValueError, match="empty sequence"):
        v1([], is_split_into_words=True)
    with pytest.raises(ValueError, match="empty word 1"):
        v1(["M", "", "K"], is_split_into_words=True)


def test_whole_special_tokens_inline(v1: ANKHTokenizer, v3: ANKHTokenizer) -> None:
    assert v1("M<extra_id_0>K")["input_ids"] == [19, V1_SENTINEL0, 14, 1]
    assert v1("<extra_id_99></s><unk>")["input_ids"] == [44, 1, 2, 1]
    assert v3.tokenize("[NLU]MK<extra_id_0>") == ["[NLU]", "M", "K", "<extra_id_0>"]


def test_decode(v1: ANKHTokenizer, v3: ANKHTokenizer) -> None:
    ids = v1(REFERENCE)["input_ids"]
    assert v1.decode(ids) == REFERENCE + "</s>"
    assert v1.decode(ids, skip_special_tokens=True) == REFERENCE
    batch = v1(["MKT", "MCADP"], padding=True)["input_ids"]
    assert v1.batch_decode(batch, skip_special_tokens=True) == ["MKT", "MCADP"]
    assert v1.convert_ids_to_tokens(ids[:3]) == ["M", "C", "A"]
    assert v1.convert_tokens_to_string(["M", "K"]) == "MK"
    assert v1.decode([19, V1_SENTINEL0, 14]) == "M<extra_id_0>K"
    prefixed = v3(REFERENCE, task_prefix="[NLU]")["input_ids"]
    assert v3.decode(prefixed) == "[NLU]" + REFERENCE + "</s>"
    assert v3.decode(prefixed, skip_special_tokens=True) == REFERENCE


# --- ANKH3 task prefixes ---------------------------------------------------------------------------------------


def test_task_prefix_option(v1: ANKHTokenizer, v3: ANKHTokenizer, artifacts: dict[str, Path], tmp_path: Path) -> None:
    assert v3.task_prefix is None and v3.task_prefixes == ("[NLU]", "[S2S]") and v1.task_prefixes == ()
    assert v3(REFERENCE)["input_ids"] == [*V3_REFERENCE, 1]  # off by default (the FastPLMs goldens omit it)
    batch = v3(["MK", "MKTA"], task_prefix="[S2S]", padding=True, return_special_tokens_mask=True)
    assert batch["input_ids"] == [[S2S, 24, 18, 1, 0, 0], [S2S, 24, 18, 14, 8, 1]]
    assert batch["special_tokens_mask"] == [[1, 0, 0, 1, 1, 1], [1, 0, 0, 0, 0, 1]]
    assert v3(list("MK"), is_split_into_words=True, task_prefix="[NLU]")["input_ids"] == [NLU, 24, 18, 1]
    assert v3("MK", task_prefix="[NLU]", add_special_tokens=False)["input_ids"] == [24, 18]
    assert v3("MK")["input_ids"] == [24, 18, 1]  # the per-call prefix does not stick
    # Seq2seq labels never get a prefix.
    out = v3("MK", text_target="AC", task_prefix="[S2S]")
    assert out["input_ids"] == [S2S, 24, 18, 1] and out["labels"] == [8, 25, 1]
    # A constructor default, saved with the tokenizer; None in a call turns it off.
    nlu = ANKHTokenizer.from_pretrained(str(artifacts["v3"]), task_prefix="[NLU]")
    assert nlu("MK")["input_ids"] == [NLU, 24, 18, 1] and nlu("MK", task_prefix=None)["input_ids"] == [24, 18, 1]
    assert nlu("MK", task_prefix="[S2S]")["input_ids"] == [S2S, 24, 18, 1]
    assert nlu.build_inputs_with_special_tokens([24, 18]) == [NLU, 24, 18, 1]
    assert nlu.get_special_tokens_mask([24, 18]) == [1, 0, 0, 1]
    nlu.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())["task_prefix"] == "[NLU]"
    assert ANKHTokenizer.from_pretrained(str(tmp_path / "saved"))("MK")["input_ids"] == [NLU, 24, 18, 1]
    with pytest.raises(ValueError, match=r"task prefix '\[NLU\]' is not in this vocabulary: only ANKH3"):
        v1("MK", task_prefix="[NLU]")
    with pytest.raises(ValueError, match=r"task prefix '\[S2S\]' is not in this vocabulary"):
        ANKHTokenizer.from_pretrained(str(artifacts["v1"]), task_prefix="[S2S]")
    with pytest.raises(ValueError, match="task_prefix must be None or one of"):
        v3("MK", task_prefix="<extra_id_0>")


def test_no_warnings_or_logs(v3: ANKHTokenizer, caplog: pytest.LogCaptureFixture) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.WARNING):
            v3(["MKT", "M"], task_prefix="[NLU]", padding=True, return_tensors="pt")
            v3.decode([24, 1])
    assert caplog.records == []


# --- the artifact's files --------------------------------------------------------------------------------------


def test_tokenizer_files_content(artifacts: dict[str, Path], snapshots: dict[str, Path], tmp_path: Path) -> None:
    paths = tokenizer_files(tmp_path / "art", snapshots["v3"], model_max_length=4096)
    assert [p.name for p in paths] == ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    config = json.loads(paths[1].read_text())
    assert config["auto_map"] == {"AutoTokenizer": [None, "tokenization_ankh.ANKHTokenizer"]}
    assert config["tokenizer_class"] == "ANKHTokenizer" and config["model_max_length"] == 4096
    assert config["task_prefix"] is None and config["padding_side"] == "right"
    assert (config["eos_token"], config["unk_token"], config["pad_token"]) == ("</s>", "<unk>", "<pad>")
    assert config["extra_special_tokens"][:2] == ["[NLU]", "[S2S]"] and len(config["extra_special_tokens"]) == 102
    special = json.loads(paths[2].read_text())
    assert special == {k: config[k] for k in special}
    # Every id is the official one; only the pipeline around the vocabulary is ours.
    for name in ("v1", "v1m", "v3"):
        written = Tokenizer.from_file(str(artifacts[name] / "tokenizer.json"))
        assert written.get_vocab() == Tokenizer.from_file(str(snapshots[name] / "tokenizer.json")).get_vocab()
        data = json.loads((artifacts[name] / "tokenizer.json").read_text())
        assert data["normalizer"] is None and data["decoder"] == {"type": "Fuse"}
        assert data["pre_tokenizer"]["type"] == "Split"
    assert ANKHTokenizer.from_pretrained(str(tmp_path / "art")).model_max_length == 4096


def test_tokenizer_files_refusals(snapshots: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="pass its folder"):
        tokenizer_files(tmp_path / "a", ("<pad>", "</s>"), 1024)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither spiece.model nor tokenizer.json"):
        tokenizer_files(tmp_path / "a", tmp_path / "empty")
    # spiece.model and tokenizer.json that disagree on an id.
    bad = tmp_path / "disagree"
    shutil.copytree(snapshots["v3"], bad)
    data = json.loads((bad / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab[7], vocab[8] = vocab[8], vocab[7]
    (bad / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="spiece.model and tokenizer.json disagree"):
        tokenizer_files(tmp_path / "a", bad)
    # A spiece.model with a dummy prefix: the official per-residue encoding would be '▁' + residue.
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    proto = model_pb2.ModelProto.FromString((snapshots["v3"] / "spiece.model").read_bytes())
    proto.normalizer_spec.add_dummy_prefix = True
    prefixed = tmp_path / "prefixed"
    prefixed.mkdir()
    (prefixed / "spiece.model").write_bytes(proto.SerializeToString())
    with pytest.raises(ValueError, match="adds a dummy prefix"):
        tokenizer_files(tmp_path / "a", prefixed)
    # A vocabulary whose pad/eos/unk are not at T5's 0/1/2.
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    data = json.loads((snapshots["v1"] / "tokenizer.json").read_text())
    data["model"]["vocab"][0], data["model"]["vocab"][1] = data["model"]["vocab"][1], data["model"]["vocab"][0]
    for token in data["added_tokens"]:
        token["id"] = {0: 1, 1: 0}.get(token["id"], token["id"])
    (swapped / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="expected the T5 ids"):
        tokenizer_files(tmp_path / "a", swapped)
    with pytest.raises(ValueError, match="expected the T5 ids"):
        ANKHTokenizer(tokenizer_file=str(swapped / "tokenizer.json"))


def test_runtime_module_imports_only_what_artifacts_allow() -> None:
    assert runtime_closure(["tokenization_ankh"]) == ["tokenization_ankh"]


_LOAD_SCRIPT = r"""
import json, sys
from transformers import AutoTokenizer

out = {}
for artifact in sys.argv[2:]:
    tok = AutoTokenizer.from_pretrained(artifact, trust_remote_code=True)
    batch = tok(["MCADPSKCIYMYV", "MK"], padding=True, return_tensors="pt")
    result = {
        "class": type(tok).__name__,
        "module": type(tok).__module__,
        "ids": batch["input_ids"].tolist(),
        "mask": batch["attention_mask"].tolist(),
        "decode": tok.decode(batch["input_ids"][1], skip_special_tokens=True),
        "prefixes": list(tok.task_prefixes),
    }
    if tok.task_prefixes:
        result["nlu"] = tok("MK", task_prefix="[NLU]")["input_ids"]
    try:
        tok("MKJ")
    except ValueError as exc:
        result["error"] = str(exc)
    out[artifact] = result
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
"""


def test_remote_code_round_trip(artifacts: dict[str, Path], tmp_path: Path) -> None:
    """AutoTokenizer(trust_remote_code=True) on the artifact layout, offline, with fastplms unimportable."""
    out = tmp_path / "out.json"
    run_fresh(_LOAD_SCRIPT, out, artifacts["v1"], artifacts["v3"], tmp_path=tmp_path, timeout=300)
    result = json.loads(out.read_text())
    v1, v3 = result[str(artifacts["v1"])], result[str(artifacts["v3"])]
    for r in (v1, v3):
        assert r["class"] == "ANKHTokenizer" and r["module"].startswith("transformers_modules.")
        assert r["mask"] == [[1] * 14, [1, 1, 1] + [0] * 11] and r["decode"] == "MK"
        assert r["error"].startswith("invalid character 'J' at position 2:")
    assert v1["ids"] == [[*V1_REFERENCE, 1], [19, 14, 1] + [0] * 11] and v1["prefixes"] == []
    assert v3["ids"] == [[*V3_REFERENCE, 1], [24, 18, 1] + [0] * 11]
    assert v3["prefixes"] == ["[NLU]", "[S2S]"] and v3["nlu"] == [NLU, 24, 18, 1]
