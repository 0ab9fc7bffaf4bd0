"""Tests for the strict ESM tokenizer, including the Hub remote-code round trip and oracle agreement."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import EsmTokenizer

import fastplms.tokenization_esm as tokenization_esm
from fastplms.tokenization_esm import ESM2_VOCAB, ESMC_VOCAB, ESMTokenizer, tokenizer_files, write_vocab

M, K, T, A, Y, ILE = (ESM2_VOCAB.index(c) for c in "MKTAYI")
CLS, PAD, EOS, UNK, MASK = 0, 1, 2, 3, 32

# Valid sequences shared by both oracle checks: every residue symbol, gaps, and literal special tokens.
PANEL = [
    "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ",
    "LAGVSERTIDPKQNFYMHWCXBUZO",
    "MK<mask>T",
    "<mask>",
    "A<mask><mask>C",
    "M.-K",
    "<unk>M",
    "W" * 60,
]


def _make(tmp_path: Path, vocab: tuple[str, ...], name: str) -> ESMTokenizer:
    return ESMTokenizer(str(write_vocab(tmp_path / name, vocab)))


@pytest.fixture
def tok(tmp_path: Path) -> ESMTokenizer:
    return _make(tmp_path, ESM2_VOCAB, "esm2_vocab.txt")


@pytest.fixture
def tok_c(tmp_path: Path) -> ESMTokenizer:
    return _make(tmp_path, ESMC_VOCAB, "esmc_vocab.txt")


def test_vocab_constants() -> None:
    assert len(ESM2_VOCAB) == len(ESMC_VOCAB) == 33
    assert ESM2_VOCAB[:4] == ("<cls>", "<pad>", "<eos>", "<unk>")
    assert "".join(ESM2_VOCAB[4:29]) == "LAGVSERTIDPKQNFYMHWCXBUZO"
    assert ESM2_VOCAB[29:] == (".", "-", "<null_1>", "<mask>")
    diff = [i for i, (a, b) in enumerate(zip(ESM2_VOCAB, ESMC_VOCAB, strict=True)) if a != b]
    assert diff == [31] and ESMC_VOCAB[31] == "|"


def test_vocab_file_decides_flavour(tok: ESMTokenizer, tok_c: ESMTokenizer) -> None:
    assert (tok.vocab_name, tok_c.vocab_name) == ("esm2", "esmc")
    assert tok.get_vocab() == {t: i for i, t in enumerate(ESM2_VOCAB)}
    assert len(tok) == tok.vocab_size == 33


def test_unknown_vocab_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_text("\n".join(ESM2_VOCAB[:-1]) + "\n")
    with pytest.raises(ValueError, match="unrecognised ESM vocabulary"):
        ESMTokenizer(str(path))
    with pytest.raises(ValueError, match="unrecognised ESM vocabulary"):
        write_vocab(tmp_path / "bad2.txt", ["<cls>", "A"])


def test_single_sequence(tok: ESMTokenizer) -> None:
    out = tok("MKTAYIAK")
    assert out["input_ids"] == [CLS, M, K, T, A, Y, ILE, A, K, EOS]
    assert out["attention_mask"] == [1] * 10
    assert set(out) == {"input_ids", "attention_mask"}


def test_batch_right_pads(tok: ESMTokenizer) -> None:
    out = tok(["MKT", "MKTAYI"], padding=True, return_tensors="pt")
    assert out["input_ids"].tolist() == [
        [CLS, M, K, T, EOS, PAD, PAD, PAD],
        [CLS, M, K, T, A, Y, ILE, EOS],
    ]
    assert out["attention_mask"].tolist() == [[1] * 5 + [0] * 3, [1] * 8]


def test_pad_to_max_length(tok: ESMTokenizer) -> None:
    out = tok(["MKT"], padding="max_length", max_length=7)
    assert out["input_ids"] == [[CLS, M, K, T, EOS, PAD, PAD]]
    assert out["attention_mask"] == [[1, 1, 1, 1, 1, 0, 0]]


@pytest.mark.parametrize("max_length", [3, 5, 8])
def test_truncation_keeps_eos(tok: ESMTokenizer, max_length: int) -> None:
    ids = tok("MKTAYIAK", truncation=True, max_length=max_length)["input_ids"]
    full = tok("MKTAYIAK")["input_ids"]
    assert len(ids) == max_length
    assert ids == full[: max_length - 1] + [EOS]


def test_truncation_with_padding_in_batch(tok: ESMTokenizer) -> None:
    out = tok(["MKTAYIAK", "MK"], truncation=True, padding="max_length", max_length=5, return_tensors="pt")
    assert out["input_ids"].tolist() == [[CLS, M, K, T, EOS], [CLS, M, K, EOS, PAD]]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("MK<mask>T", [CLS, M, K, MASK, T, EOS]),
        ("<unk>M", [CLS, UNK, M, EOS]),
        ("M<pad>", [CLS, M, PAD, EOS]),
        ("<cls>M<eos>", [CLS, CLS, M, EOS, EOS]),
        ("<mask><mask>", [CLS, MASK, MASK, EOS]),
    ],
)
def test_special_tokens_in_text_are_single_tokens(tok: ESMTokenizer, text: str, expected: list[int]) -> None:
    assert tok(text)["input_ids"] == expected


@pytest.mark.parametrize(
    ("text", "char", "position"),
    [
        ("MKJT", "J", 2),
        ("MK1", "1", 2),
        ("mKT", "m", 0),
        ("MK T", " ", 2),
        ("MKT\n", "\n", 3),
        ("MK<mask>TJ", "J", 9),  # position counts the literal "<mask>" characters in the caller's string
        ("MK<mask", "<", 2),  # a broken special token is not silently accepted
        ("A|B", "|", 1),  # chain break only exists in the ESMC vocabulary
    ],
)
def test_invalid_character_raises(tok: ESMTokenizer, text: str, char: str, position: int) -> None:
    with pytest.raises(ValueError) as info:
        tok(text)
    message = str(info.value)
    assert f"{char!r} at position {position}" in message
    assert "LAGVSERTIDPKQNFYMHWCXBUZO.-" in message


def test_invalid_character_in_batch_raises(tok: ESMTokenizer) -> None:
    with pytest.raises(ValueError, match="'1' at position 2"):
        tok(["MKT", "MK1"], padding=True)


def test_empty_sequence_raises(tok: ESMTokenizer) -> None:
    with pytest.raises(ValueError, match="empty sequence"):
        tok("")
    with pytest.raises(ValueError, match="empty sequence"):
        tok(["MKT", ""], padding=True)


def test_split_special_tokens_makes_brackets_invalid(tok: ESMTokenizer) -> None:
    with pytest.raises(ValueError, match="'<' at position 2"):
        tok("MK<mask>T", split_special_tokens=True)


def test_chain_break(tok: ESMTokenizer, tok_c: ESMTokenizer) -> None:
    assert tok_c("MK|TA")["input_ids"] == [CLS, M, K, 31, T, A, EOS]
    with pytest.raises(ValueError, match="'<' at position 1"):
        tok_c("M<null_1>")  # ESM2-only placeholder token
    with pytest.raises(ValueError, match=re.escape("'|' at position 2")):
        tok("MK|TA")


def test_no_silent_unk_for_token_lists(tok: ESMTokenizer) -> None:
    with pytest.raises(ValueError, match="'J' is not in the esm2 vocabulary"):
        tok.convert_tokens_to_ids(["M", "J"])
    with pytest.raises(ValueError, match="token id 40"):
        tok.convert_ids_to_tokens([0, 40])


def test_decode(tok: ESMTokenizer, tok_c: ESMTokenizer) -> None:
    assert tok.decode(tok("MKTAYIAK")["input_ids"], skip_special_tokens=True) == "MKTAYIAK"
    assert tok.decode(tok("MKT")["input_ids"]) == "<cls>MKT<eos>"
    batch = tok(["MKT", "MKTAYI"], padding=True)["input_ids"]
    assert tok.batch_decode(batch, skip_special_tokens=True) == ["MKT", "MKTAYI"]
    assert tok_c.decode(tok_c("MK|T")["input_ids"], skip_special_tokens=True) == "MK|T"


def test_special_tokens_mask(tok: ESMTokenizer) -> None:
    out = tok("MKT", return_special_tokens_mask=True)
    assert out["special_tokens_mask"] == [1, 0, 0, 0, 1]
    assert tok.get_special_tokens_mask([CLS, M, MASK, EOS, PAD], already_has_special_tokens=True) == [
        1,
        0,
        1,
        1,
        1,
    ]


def test_pair_joined_by_eos(tok: ESMTokenizer) -> None:
    out = tok("MK", "TA", return_token_type_ids=True)
    assert out["input_ids"] == [CLS, M, K, EOS, T, A, EOS]
    assert out["token_type_ids"] == [0] * 7


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_model_max_length_warns_but_never_truncates_silently(tok: ESMTokenizer) -> None:
    assert tok.model_max_length == 1026
    records = _Records()
    logger = logging.getLogger("transformers")
    logger.addHandler(records)
    try:
        ids = tok("A" * 2000)["input_ids"]
    finally:
        logger.removeHandler(records)
    assert len(ids) == 2002 and ids[-1] == EOS
    assert any("2002 > 1026" in m for m in records.messages)
    # truncation=True without max_length falls back to model_max_length, still keeping <eos>.
    truncated = tok("A" * 2000, truncation=True)["input_ids"]
    assert len(truncated) == 1026 and truncated[-1] == EOS


def test_save_pretrained_round_trip(tok_c: ESMTokenizer, tmp_path: Path) -> None:
    saved = tmp_path / "saved"
    tok_c.save_pretrained(saved)
    assert (saved / "vocab.txt").read_text().splitlines() == list(ESMC_VOCAB)
    again = ESMTokenizer.from_pretrained(saved)
    assert again.vocab_name == "esmc" and again.model_max_length == 1026
    assert again("MK|<mask>")["input_ids"] == tok_c("MK|<mask>")["input_ids"]


def test_tokenizer_files_content(tmp_path: Path) -> None:
    paths = tokenizer_files(tmp_path / "art", ESM2_VOCAB)
    assert sorted(p.name for p in paths) == ["special_tokens_map.json", "tokenizer_config.json", "vocab.txt"]
    config = json.loads((tmp_path / "art" / "tokenizer_config.json").read_text())
    assert config["auto_map"] == {"AutoTokenizer": ["tokenization_esm.ESMTokenizer", None]}
    assert config["tokenizer_class"] == "ESMTokenizer"
    assert config["model_max_length"] == 1026 and config["padding_side"] == "right"
    special = json.loads((tmp_path / "art" / "special_tokens_map.json").read_text())
    assert special == {k: config[k] for k in special}
    assert special["mask_token"] == "<mask>"


# One subprocess serves all remote-code checks: importing Transformers costs seconds per interpreter.
_LOAD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from transformers import AutoTokenizer

    def encode(path):
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
        batch = tok(["MKT", "MK<mask>TAYI"], padding=True)
        result = {
            "class": type(tok).__name__,
            "module": type(tok).__module__,
            "single": tok("MKTAYIAK")["input_ids"],
            "batch": batch["input_ids"],
            "mask": batch["attention_mask"],
            "decoded": tok.decode(batch["input_ids"][1], skip_special_tokens=True),
            "model_max_length": tok.model_max_length,
        }
        try:
            tok("MKJ")
        except ValueError as exc:
            result["error"] = str(exc)
        return tok, result

    results = {}
    for path in sys.argv[2:]:
        entry = {}
        try:  # first, the default: no trust_remote_code
            AutoTokenizer.from_pretrained(path)
            entry["untrusted"] = "loaded"
        except Exception as exc:
            entry["untrusted"] = f"{type(exc).__name__}: {exc}"
        tok, entry["trusted"] = encode(path)
        tok.save_pretrained(path + "_resaved")
        entry["resaved"] = encode(path + "_resaved")[1]
        results[path] = entry
    with open(sys.argv[1], "w") as f:  # not stdout: Transformers' trust prompt writes there
        json.dump(results, f)
    """
)


@pytest.fixture(scope="module")
def remote_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Build one artifact per vocabulary and load each through AutoTokenizer in an offline subprocess."""
    root = tmp_path_factory.mktemp("remote")
    artifacts = {}
    for name, vocab in (("esm2", ESM2_VOCAB), ("esmc", ESMC_VOCAB)):
        artifact = root / name
        artifact.mkdir()
        shutil.copy(tokenization_esm.__file__, artifact / "tokenization_esm.py")
        tokenizer_files(artifact, vocab)
        artifacts[name] = artifact
    script = root / "load_tokenizer.py"
    script.write_text(_LOAD_SCRIPT)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_MODULES_CACHE": str(root / "modules"),
    }
    # stdin closed: without trust_remote_code, Transformers would otherwise wait on an interactive prompt.
    proc = subprocess.run(
        [sys.executable, str(script), str(root / "results.json"), *map(str, artifacts.values())],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert any((root / "modules").rglob("tokenization_esm.py"))  # the module cache really was used
    results = json.loads((root / "results.json").read_text())
    return {name: {**results[str(path)], "dir": path} for name, path in artifacts.items()}


@pytest.mark.parametrize("name", ["esm2", "esmc"])
@pytest.mark.parametrize("stage", ["trusted", "resaved"])
def test_remote_code_round_trip(remote_results: dict[str, dict[str, Any]], name: str, stage: str) -> None:
    result = remote_results[name][stage]
    assert result["class"] == "ESMTokenizer"
    assert result["module"].startswith("transformers_modules.")  # the copied file, not fastplms'
    assert result["single"] == [CLS, M, K, T, A, Y, ILE, A, K, EOS]
    assert result["batch"] == [[CLS, M, K, T, EOS] + [PAD] * 4, [CLS, M, K, MASK, T, A, Y, ILE, EOS]]
    assert result["mask"] == [[1] * 5 + [0] * 4, [1] * 9]
    assert result["decoded"] == "MKTAYI"
    assert result["model_max_length"] == 1026
    assert "'J' at position 2" in result["error"]


@pytest.mark.parametrize(("name", "vocab"), [("esm2", ESM2_VOCAB), ("esmc", ESMC_VOCAB)])
def test_remote_code_resave_keeps_files(
    remote_results: dict[str, dict[str, Any]], name: str, vocab: tuple[str, ...]
) -> None:
    # save_pretrained on a remote-code tokenizer copies the module and writes auto_map itself.
    resaved = Path(str(remote_results[name]["dir"]) + "_resaved")
    assert (resaved / "tokenization_esm.py").is_file()
    assert (resaved / "vocab.txt").read_text().splitlines() == list(vocab)
    config = json.loads((resaved / "tokenizer_config.json").read_text())
    assert config["auto_map"]["AutoTokenizer"][0] == "tokenization_esm.ESMTokenizer"


@pytest.mark.parametrize("name", ["esm2", "esmc"])
def test_remote_code_requires_trust(remote_results: dict[str, dict[str, Any]], name: str) -> None:
    untrusted = remote_results[name]["untrusted"]
    assert untrusted.startswith("ValueError:") and "trust_remote_code=True" in untrusted


def test_matches_transformers_esm_tokenizer(tok: ESMTokenizer, tmp_path: Path) -> None:
    oracle = EsmTokenizer(str(write_vocab(tmp_path / "oracle_vocab.txt", ESM2_VOCAB)))
    for seq in [*PANEL, "M<null_1>K"]:
        assert tok(seq)["input_ids"] == oracle(seq)["input_ids"], seq
    ours = tok(PANEL, padding=True, return_tensors="pt")
    theirs = oracle(PANEL, padding=True, return_tensors="pt")
    assert torch.equal(ours["input_ids"], theirs["input_ids"])
    assert torch.equal(ours["attention_mask"], theirs["attention_mask"])


def test_matches_fair_esm_batch_converter(tok: ESMTokenizer) -> None:
    import esm  # fair-esm, a dev dependency; imported here to keep test collection fast

    alphabet = esm.data.Alphabet.from_architecture("ESM-1b")
    assert tuple(alphabet.all_toks) == ESM2_VOCAB
    _, _, expected = alphabet.get_batch_converter()([(str(i), s) for i, s in enumerate(PANEL)])
    ours = tok(PANEL, padding=True, return_tensors="pt")["input_ids"]
    assert torch.equal(ours, expected)
