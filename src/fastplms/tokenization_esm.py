"""Strict character-level tokenizer for ESM2 and ESMC protein language models.

Runtime module: it is copied flat into Hub artifacts and imported by Transformers' remote-code loader,
so it imports only the standard library and transformers, and does nothing at import time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers.tokenization_python import PythonBackend

_SPECIALS_HEAD = ("<cls>", "<pad>", "<eos>", "<unk>")
_RESIDUES = tuple("LAGVSERTIDPKQNFYMHWCXBUZO")

# Line number in vocab.txt is the token id, so the order of these tuples is the model's embedding order.
ESM2_VOCAB: tuple[str, ...] = (*_SPECIALS_HEAD, *_RESIDUES, ".", "-", "<null_1>", "<mask>")
# ESMC reuses ESM2's layout but spends id 31 on the chain-break token "|".
ESMC_VOCAB: tuple[str, ...] = (*_SPECIALS_HEAD, *_RESIDUES, ".", "-", "|", "<mask>")

_KNOWN_VOCABS: dict[str, tuple[str, ...]] = {"esm2": ESM2_VOCAB, "esmc": ESMC_VOCAB}
_SPECIAL_TOKENS: dict[str, str] = {
    "cls_token": "<cls>",
    "pad_token": "<pad>",
    "eos_token": "<eos>",
    "unk_token": "<unk>",
    "mask_token": "<mask>",
}
VOCAB_FILE_NAME = "vocab.txt"
# ESM2 was trained on 1024 residues plus <cls> and <eos>.
DEFAULT_MODEL_MAX_LENGTH = 1026


def _check_vocab(tokens: Sequence[str]) -> str:
    """Return the name of the known vocabulary ``tokens`` spells, or raise.

    Ids index straight into model embeddings, so an unexpected vocabulary would silently scramble inputs.
    """
    for name, known in _KNOWN_VOCABS.items():
        if tuple(tokens) == known:
            return name
    raise ValueError(
        f"unrecognised ESM vocabulary ({len(tokens)} tokens, starting {list(tokens[:6])}); "
        "expected exactly ESM2_VOCAB or ESMC_VOCAB"
    )


def write_vocab(path: str | Path, vocab: Sequence[str]) -> Path:
    """Write ``vocab`` one token per line (line number = id) and return the path."""
    _check_vocab(vocab)
    path = Path(path)
    path.write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return path


def _read_vocab(path: str | Path) -> tuple[str, ...]:
    return tuple(Path(path).read_text(encoding="utf-8").splitlines())


class ESMTokenizer(PythonBackend):
    """One token per residue, ``<cls>`` + residues + ``<eos>``, refusing anything outside the alphabet.

    The vocabulary file decides between ESM2 (id 31 ``<null_1>``) and ESMC (id 31 ``|``, chain break).
    """

    vocab_files_names = {"vocab_file": VOCAB_FILE_NAME}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str | Path,
        cls_token: str = "<cls>",
        pad_token: str = "<pad>",
        eos_token: str = "<eos>",
        unk_token: str = "<unk>",
        mask_token: str = "<mask>",
        model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
        **kwargs: Any,
    ) -> None:
        # The base __init__ calls get_vocab(), so the vocabulary must exist before super().__init__.
        self.vocab_file = vocab_file
        self._id_to_token: tuple[str, ...] = _read_vocab(vocab_file)
        self.vocab_name = _check_vocab(self._id_to_token)
        self._token_to_id: dict[str, int] = {tok: i for i, tok in enumerate(self._id_to_token)}
        # Single characters are residues (plus gap/insertion/chain-break symbols); everything longer is a
        # bracketed token that may only appear whole.
        self._alphabet = "".join(tok for tok in self._id_to_token if len(tok) == 1)
        self._multichar_vocab = frozenset(tok for tok in self._id_to_token if len(tok) > 1)
        super().__init__(
            cls_token=cls_token,
            pad_token=pad_token,
            eos_token=eos_token,
            unk_token=unk_token,
            mask_token=mask_token,
            model_max_length=model_max_length,
            **kwargs,
        )
        # The base trie only knows added/special tokens; <null_1> is a plain vocab token but must split whole.
        self._update_trie(sorted(self._multichar_vocab))

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_token)

    def get_vocab(self) -> dict[str, int]:
        return {**self._token_to_id, **self._added_tokens_encoder}

    def tokenize(self, text: str, **kwargs: Any) -> list[str]:
        # Overridden (rather than only _tokenize) so errors can report positions in the caller's string:
        # the base class hands _tokenize fragments between special tokens and loses their offsets.
        split_special_tokens = kwargs.pop("split_special_tokens", self.split_special_tokens)
        text, _ = self.prepare_for_tokenization(text, **kwargs)
        if not text:
            raise ValueError("empty sequence: a protein sequence needs at least one token")
        pieces = [text] if split_special_tokens else self.tokens_trie.split(text)
        whole = self._multichar_vocab | self._added_tokens_encoder.keys()
        tokens: list[str] = []
        offset = 0
        for piece in pieces:
            if not split_special_tokens and piece in whole:
                tokens.append(piece)
            else:
                tokens.extend(self._tokenize(piece, offset=offset))
            offset += len(piece)
        return tokens

    def _tokenize(self, text: str, offset: int = 0, **kwargs: Any) -> list[str]:
        for i, char in enumerate(text):
            if char not in self._alphabet:
                raise ValueError(
                    f"invalid character {char!r} at position {offset + i}: expected one of "
                    f"{self._alphabet!r} or a whole special token such as '<mask>'"
                )
        return list(text)

    def _convert_token_to_id(self, token: str) -> int:
        # No <unk> fallback: an unknown token here means the caller bypassed tokenize() with bad input.
        if token not in self._token_to_id:
            raise ValueError(f"token {token!r} is not in the {self.vocab_name} vocabulary")
        return self._token_to_id[token]

    def _convert_id_to_token(self, index: int) -> str:
        if not 0 <= index < len(self._id_to_token):
            raise ValueError(f"token id {index} is outside the {self.vocab_name} vocabulary")
        return self._id_to_token[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        # Residues are characters of one string, not words.
        return "".join(tokens)

    def build_inputs_with_special_tokens(
        self, token_ids_0: list[int], token_ids_1: list[int] | None = None
    ) -> list[int]:
        # ESM has no separator token; pairs are joined by <eos>, as Transformers' EsmTokenizer does.
        ids = [self.cls_token_id, *token_ids_0, self.eos_token_id]
        if token_ids_1 is not None:
            ids += [*token_ids_1, self.eos_token_id]
        return ids

    def get_special_tokens_mask(
        self,
        token_ids_0: list[int],
        token_ids_1: list[int] | None = None,
        already_has_special_tokens: bool = False,
    ) -> list[int]:
        if already_has_special_tokens:
            return super().get_special_tokens_mask(token_ids_0, token_ids_1, already_has_special_tokens=True)
        mask = [1, *([0] * len(token_ids_0)), 1]
        if token_ids_1 is not None:
            mask += [*([0] * len(token_ids_1)), 1]
        return mask

    def create_token_type_ids_from_sequences(
        self, token_ids_0: list[int], token_ids_1: list[int] | None = None
    ) -> list[int]:
        # ESM models have no segment embeddings.
        return [0] * len(self.build_inputs_with_special_tokens(token_ids_0, token_ids_1))

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        name = f"{filename_prefix}-{VOCAB_FILE_NAME}" if filename_prefix else VOCAB_FILE_NAME
        path = write_vocab(Path(save_directory) / name, self._id_to_token)
        return (str(path),)


def write_tokenizer_files(
    directory: str | Path,
    vocab: Sequence[str],
    model_max_length: int,
    *,
    tokenizer_class: type[PythonBackend],
    module: str,
    special_tokens: Mapping[str, str],
    vocab_writer: Callable[[Path, Sequence[str]], Path],
) -> list[Path]:
    """Write the tokenizer files of a remote-code artifact for ``tokenizer_class``, defined in the runtime
    module ``module`` (the caller copies it beside them): ``vocab_writer``'s vocab.txt, tokenizer_config.json
    (``auto_map`` to ``module.tokenizer_class``, ``special_tokens``) and special_tokens_map.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab_path = vocab_writer(directory / VOCAB_FILE_NAME, vocab)
    config = {
        "tokenizer_class": tokenizer_class.__name__,
        # Slow class only: there is no fast counterpart, hence the null second slot.
        "auto_map": {"AutoTokenizer": [f"{module}.{tokenizer_class.__name__}", None]},
        "model_max_length": model_max_length,
        "padding_side": "right",
        "truncation_side": "right",
        "model_input_names": tokenizer_class.model_input_names,
        "clean_up_tokenization_spaces": False,
        **special_tokens,
    }
    config_path = directory / "tokenizer_config.json"
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    special_path = directory / "special_tokens_map.json"
    special_path.write_text(json.dumps(dict(special_tokens), indent=2) + "\n", encoding="utf-8")
    return [vocab_path, config_path, special_path]


def tokenizer_files(
    directory: str | Path, vocab: Sequence[str], model_max_length: int = DEFAULT_MODEL_MAX_LENGTH
) -> list[Path]:
    """Write the tokenizer files of a remote-code artifact; the caller copies this module beside them."""
    return write_tokenizer_files(
        directory,
        vocab,
        model_max_length,
        tokenizer_class=ESMTokenizer,
        module="tokenization_esm",
        special_tokens=_SPECIAL_TOKENS,
        vocab_writer=write_vocab,
    )
