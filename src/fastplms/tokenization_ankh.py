"""Strict residue-level tokenizer for ANKH (ElnaggarLab T5 v1.1 protein models), every generation.

Runtime module: it is copied flat into Hub artifacts and imported by Transformers' remote-code loader, so it
imports only the standard library and transformers (whose ``tokenizers`` backend it drives through
``PreTrainedTokenizerFast``, never by importing it), and does nothing at import time.

Contract. Raw residue strings go in (``"MKTAYIAKQR"``); each residue is one token, with the id the official
feature extraction gives it (agemagician/Ankh@02b4e25 tokenizes ``list(seq)`` with ``is_split_into_words=True,
add_special_tokens=True``): ``residue ids ... </s>``, no leading ``<unk>``, right padding with ``<pad>`` (id 0)
and an attention mask. A character outside the vocabulary's residues is a ``ValueError`` naming it and its
position, never a silent ``<unk>``; an empty sequence is an error. Whole special tokens (``<extra_id_0>``, the
sentinel the official pseudo-likelihood masks with, ``</s>``, ...) may appear inside a sequence. ``list(seq)``
with ``is_split_into_words=True`` encodes exactly like ``seq``.

The vocabulary is the official snapshot's, unchanged (ids are embedding rows): ankh-base, ankh-large and
ankh2-* share one ``tokenizer.json`` (residues at 3..22, 144 ids); ankh3-large and -xl one ``spiece.model``
(residues at 7..26, 256 ids), which the official code reads with the slow SentencePiece ``T5Tokenizer`` and
``tokenizer_files`` converts at build time into an equivalent ``tokenizer.json``, so that nothing here needs
sentencepiece or protobuf. What the snapshot's file does *not* decide is the pipeline around the vocabulary:
``ANKHTokenizer`` always installs its own (no normalizer; one pre-token per character; ``$A </s>``; a
decoder that joins residues), so no ``▁``/``<unk>`` artefact can appear. Transformers 5's own ``T5Tokenizer``
(what its ``AutoTokenizer`` returns for an official snapshot) rebuilds ``WhitespaceSplit +
Metaspace(prepend_scheme="always")`` over the vocabulary whatever the file says: raw strings then get one
leading ``▁`` piece, ``<unk>`` in v1/v2, which have no ``▁``, and ``is_split_into_words`` input one before every
residue. The official 4.25.1 stack ran the file's own pipeline, and on raw strings gave exactly the residue ids
(the FastPLMs goldens).

ANKH3 task prefixes. The official ANKH3 code prepends ``"[NLU]"`` for embedding and ``"[S2S]"`` for generation
(likelihood.py). Here they are an explicit option, off by default: ``tokenizer(seqs, task_prefix="[NLU]")``, or
``ANKHTokenizer.from_pretrained(..., task_prefix="[NLU]")`` for every call (``task_prefix=None`` in a call turns
a default off). Off by default because the FastPLMs goldens (official outputs that fastplms artifacts are
checked against) were encoded without them, so the default keeps ids, positions and outputs comparable across
generations. A prefix is a special token, placed first (before any pair) and only with
``add_special_tokens=True``; labels (``text_target``) never get one. A vocabulary without the token (ANKH v1/v2
have neither) is an error.
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "</s>", "<unk>"
# T5 ids the ANKH configs assume (pad_token_id 0 = decoder start, eos_token_id 1); checked on every load.
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
TASK_PREFIXES = ("[NLU]", "[S2S]")
CANONICAL_RESIDUES = "ACDEFGHIKLMNPQRSTVWY"  # every ANKH vocabulary has these as single-character pieces
TOKENIZER_FILE = "tokenizer.json"
SPIECE_FILE = "spiece.model"
NUM_SENTINELS = 100  # T5's default extra_ids: <extra_id_0> is the last id
# T5 has relative positions only: no length limit of its own (Transformers' "no limit" value).
DEFAULT_MODEL_MAX_LENGTH = 1000000000000000019884624838656
_SPECIAL_TOKENS: dict[str, str] = {"eos_token": EOS_TOKEN, "unk_token": UNK_TOKEN, "pad_token": PAD_TOKEN}
_PER_CHARACTER = {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": False}
_JOIN = {"type": "Fuse"}
_DEFAULT = object()  # "use the tokenizer's task_prefix"


# --- the pipeline around the vocabulary, as tokenizers JSON (no import of tokenizers needed) --------------------


def _vocabulary(data: Mapping[str, Any]) -> dict[str, int]:
    """Token -> id of a tokenizers JSON: the model's vocabulary and the added tokens."""
    vocab = data.get("model", {}).get("vocab")
    if isinstance(vocab, list):
        ids = {entry[0]: i for i, entry in enumerate(vocab)}
    elif isinstance(vocab, dict):
        ids = dict(vocab)
    else:
        raise ValueError("tokenizer.json has no model vocabulary")
    ids.update({token["content"]: token["id"] for token in data.get("added_tokens", [])})
    return ids


def _residue_alphabet(vocab: Mapping[str, int], added: Iterable[str]) -> str:
    """Residues are the single-character pieces that are neither added tokens nor whitespace/``▁``."""
    added = set(added)
    return "".join(
        sorted(t for t in vocab if len(t) == 1 and t not in added and t != "▁" and t.isprintable() and not t.isspace())
    )


def _check_vocabulary(vocab: Mapping[str, int], alphabet: str, origin: str) -> None:
    expected = {PAD_TOKEN: PAD_ID, EOS_TOKEN: EOS_ID, UNK_TOKEN: UNK_ID}
    found = {token: vocab.get(token) for token in expected}
    if found != expected:
        raise ValueError(f"{origin}: expected the T5 ids {expected} (the ANKH configs assume them), found {found}")
    missing = [r for r in CANONICAL_RESIDUES if r not in alphabet]
    if missing:
        raise ValueError(
            f"{origin}: the residues {''.join(missing)!r} are not single-character pieces of this vocabulary; "
            "it is not an ANKH vocabulary"
        )


def _added_token(index: int, content: str) -> dict[str, Any]:
    """A special added token of tokenizers JSON: matched whole in the raw text, never normalized."""
    return {"id": index, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}  # fmt: skip


def _template(prefix: str | None, ids: Mapping[str, int]) -> dict[str, Any]:
    def special(token: str) -> dict[str, Any]:
        return {"SpecialToken": {"id": token, "type_id": 0}}

    def sequence(name: str) -> dict[str, Any]:
        return {"Sequence": {"id": name, "type_id": 0}}

    head = [special(prefix)] if prefix is not None else []
    tokens = [EOS_TOKEN, *([prefix] if prefix is not None else [])]
    return {
        "type": "TemplateProcessing",
        "single": [*head, sequence("A"), special(EOS_TOKEN)],
        "pair": [*head, sequence("A"), special(EOS_TOKEN), sequence("B"), special(EOS_TOKEN)],
        "special_tokens": {t: {"id": t, "ids": [ids[t]], "tokens": [t]} for t in tokens},
    }


def runtime_tokenizer_json(data: Mapping[str, Any], prefix: str | None = None) -> dict[str, Any]:
    """``data`` (a tokenizers JSON) with the vocabulary and added tokens kept and ANKHTokenizer's pipeline
    around them: no normalizer, one pre-token per character, ``[prefix] $A </s>``, residues joined on decode,
    no stored padding/truncation. Task-prefix pieces become special added tokens (matched whole)."""
    data = copy.deepcopy(dict(data))
    vocab = _vocabulary(data)
    added = data.setdefault("added_tokens", [])
    present = {token["content"]: token for token in added}
    for token in TASK_PREFIXES:
        if token in present:
            present[token]["special"] = True
        elif token in vocab:
            added.append(_added_token(vocab[token], token))
    added.sort(key=lambda token: token["id"])
    data.update(
        truncation=None,
        padding=None,
        normalizer=None,
        pre_tokenizer=dict(_PER_CHARACTER),
        post_processor=_template(prefix, vocab),
        decoder=dict(_JOIN),
    )
    return data


# --- the tokenizer ---------------------------------------------------------------------------------------------


class ANKHTokenizer(PreTrainedTokenizerFast):
    """One token per residue, residues + ``</s>``, right-padded with ``<pad>``, refusing anything outside the
    vocabulary's residues; optional ANKH3 task prefix (``task_prefix``, off by default)."""

    vocab_files_names = {"tokenizer_file": TOKENIZER_FILE}
    model_input_names = ["input_ids", "attention_mask"]
    padding_side = "right"

    @classmethod
    def convert_to_native_format(cls, trust_remote_code: bool = False, **kwargs: Any) -> dict[str, Any]:
        # from_pretrained re-derives a tokenizer from the file's vocabulary for classes with their own __init__
        # unless told the class is remote code; ANKHTokenizer always wants the file itself, ids and added tokens
        # exactly as written (its pipeline is replaced in __init__ either way).
        path = kwargs.get("tokenizer_file")
        if kwargs.get("tokenizer_object") is None and (path is None or not Path(path).is_file()):
            raise ValueError(f"{cls.__name__} loads from a {TOKENIZER_FILE}, and none was found")
        return super().convert_to_native_format(trust_remote_code=True, **kwargs)

    def __init__(
        self,
        *args: Any,
        task_prefix: str | None = None,
        eos_token: str = EOS_TOKEN,
        unk_token: str = UNK_TOKEN,
        pad_token: str = PAD_TOKEN,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            *args, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token, task_prefix=task_prefix, **kwargs
        )
        data = json.loads(self._tokenizer.to_str())
        vocab = _vocabulary(data)
        self._alphabet = _residue_alphabet(vocab, (t["content"] for t in data.get("added_tokens", [])))
        _check_vocabulary(vocab, self._alphabet, type(self).__name__)
        self._pipeline = runtime_tokenizer_json(data)
        self._tokenizer = type(self._tokenizer).from_str(json.dumps(self._pipeline))
        self._tokenizer.encode_special_tokens = self.split_special_tokens
        self._processors = {None: self._tokenizer.post_processor}
        self.task_prefixes: tuple[str, ...] = tuple(t for t in TASK_PREFIXES if t in vocab)
        # Whole tokens a sequence may contain, longest first: every added token (all special).
        whole = sorted((t["content"] for t in self._pipeline["added_tokens"]), key=len, reverse=True)
        self._whole_by_first: dict[str, list[str]] = {}
        for token in whole:
            self._whole_by_first.setdefault(token[0], []).append(token)
        self._target_mode = False
        self.task_prefix = self._check_prefix(task_prefix)

    @property
    def residues(self) -> str:
        """The characters a sequence may contain (besides whole special tokens), sorted."""
        return self._alphabet

    def update_post_processor(self) -> None:
        # TokenizersBackend rebuilds a bos/eos template here; ANKH's template is fixed (set in __init__).
        processors = getattr(self, "_processors", None)
        if processors is not None:
            self._tokenizer.post_processor = processors[None]

    def _check_prefix(self, prefix: str | None) -> str | None:
        if prefix is None or prefix in self.task_prefixes:
            return prefix
        if prefix in TASK_PREFIXES:
            raise ValueError(
                f"task prefix {prefix!r} is not in this vocabulary: only ANKH3 has task prefixes "
                f"(this one has {list(self.task_prefixes) or 'none'})"
            )
        raise ValueError(f"task_prefix must be None or one of {list(TASK_PREFIXES)}, not {prefix!r}")

    def _processor(self, prefix: str | None) -> Any:
        if prefix not in self._processors:
            data = dict(self._pipeline, post_processor=_template(prefix, _vocabulary(self._pipeline)))
            self._processors[prefix] = type(self._tokenizer).from_str(json.dumps(data)).post_processor
        return self._processors[prefix]

    def _switch_to_target_mode(self) -> None:
        self._target_mode = True

    def _switch_to_input_mode(self) -> None:
        self._target_mode = False

    # --- validation ---

    def _check_text(self, text: str, where: str, offset: int = 0, *, whole_tokens: bool) -> None:
        i = 0
        while i < len(text):
            char = text[i]
            if char in self._alphabet:
                i += 1
                continue
            if whole_tokens:
                token = next((t for t in self._whole_by_first.get(char, ()) if text.startswith(t, i)), None)
                if token is not None:
                    i += len(token)
                    continue
            raise ValueError(
                f"invalid character {char!r} at position {offset + i}{where}: expected one of {self._alphabet!r} "
                "or a whole special token such as '<extra_id_0>'"
            )

    def _check_sequence(self, sequence: Any, where: str, is_split_into_words: bool, whole_tokens: bool) -> None:
        if is_split_into_words:
            if not isinstance(sequence, (list, tuple)) or not all(isinstance(w, str) for w in sequence):
                return  # not well-formed: the base class raises its own error
            if not sequence:
                raise ValueError(f"empty sequence{where}: a protein sequence needs at least one residue")
            offset = 0
            for index, word in enumerate(sequence):
                if not word:
                    raise ValueError(f"empty word {index}{where}: each word must be a residue or a special token")
                self._check_text(word, where, offset, whole_tokens=whole_tokens)
                offset += len(word)
        elif isinstance(sequence, str):
            if not sequence:
                raise ValueError(f"empty sequence{where}: a protein sequence needs at least one residue")
            self._check_text(sequence, where, whole_tokens=whole_tokens)

    def _check_inputs(self, text: Any, text_pair: Any, is_split_into_words: bool, whole_tokens: bool) -> None:
        if is_split_into_words:
            batched = isinstance(text, (list, tuple)) and bool(text) and isinstance(text[0], (list, tuple))
        else:
            batched = isinstance(text, (list, tuple))
        for name, value in (("", text), (" of text_pair", text_pair)):
            if value is None or (name and not batched and not value):
                continue
            if batched:
                if not isinstance(value, (list, tuple)):
                    continue
                for index, sequence in enumerate(value):
                    self._check_sequence(sequence, f" of batch item {index}{name}", is_split_into_words, whole_tokens)
            else:
                self._check_sequence(value, name, is_split_into_words, whole_tokens)

    def _encode_plus(self, text: Any, text_pair: Any = None, **kwargs: Any):
        prefix = kwargs.pop("task_prefix", _DEFAULT)
        prefix = self.task_prefix if prefix is _DEFAULT else self._check_prefix(prefix)
        if self._target_mode:
            prefix = None  # labels are decoder targets: no task prefix
        split = kwargs.get("split_special_tokens")
        split = self.split_special_tokens if split is None else split
        self._check_inputs(text, text_pair, bool(kwargs.get("is_split_into_words", False)), whole_tokens=not split)
        self._tokenizer.post_processor = self._processor(prefix)
        try:
            return super()._encode_plus(text, text_pair=text_pair, **kwargs)
        finally:
            self._tokenizer.post_processor = self._processors[None]

    # --- the template, for callers that assemble ids themselves ---

    def build_inputs_with_special_tokens(
        self, token_ids_0: list[int], token_ids_1: list[int] | None = None
    ) -> list[int]:
        head = [self.convert_tokens_to_ids(self.task_prefix)] if self.task_prefix is not None else []
        ids = [*head, *token_ids_0, self.eos_token_id]
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
        mask = [*([1] if self.task_prefix is not None else []), *([0] * len(token_ids_0)), 1]
        if token_ids_1 is not None:
            mask += [*([0] * len(token_ids_1)), 1]
        return mask


# --- build time: the artifact's tokenizer files from an official snapshot ------------------------------------


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data):
            raise ValueError("truncated varint")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _fields(data: bytes) -> Iterable[tuple[int, int, Any]]:
    """(field number, wire type, value) of a protobuf message: ints for varints, bytes otherwise."""
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 1:
            value, i = data[i : i + 8], i + 8
        elif wire == 2:
            size, i = _varint(data, i)
            value, i = data[i : i + size], i + size
        elif wire == 5:
            value, i = data[i : i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if i > len(data):
            raise ValueError("truncated protobuf field")
        yield number, wire, value


# sentencepiece_model.proto: ModelProto.pieces = 1, trainer_spec = 2, normalizer_spec = 3; SentencePiece.piece = 1,
# score = 2 (float), type = 3 (NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6);
# TrainerSpec.model_type = 3 (UNIGRAM 1); NormalizerSpec.add_dummy_prefix = 3 (default true).
_SP_NORMAL, _SP_UNKNOWN, _SP_CONTROL, _SP_USER_DEFINED = 1, 2, 3, 4


def read_spiece(data: bytes) -> tuple[list[tuple[str, float, int]], dict[str, Any]]:
    """The pieces ``(piece, score, type)`` of a SentencePiece model and the settings that matter here
    (``model_type``, ``add_dummy_prefix``), read with the standard library."""
    pieces: list[tuple[str, float, int]] = []
    settings: dict[str, Any] = {"model_type": 1, "add_dummy_prefix": True}
    try:
        for number, wire, value in _fields(data):
            if number == 1 and wire == 2:
                piece, score, kind = "", 0.0, _SP_NORMAL
                for n, w, v in _fields(value):
                    if n == 1 and w == 2:
                        piece = v.decode("utf-8")
                    elif n == 2 and w == 5:
                        score = struct.unpack("<f", v)[0]
                    elif n == 3 and w == 0:
                        kind = v
                pieces.append((piece, score, kind))
            elif number == 2 and wire == 2:
                for n, w, v in _fields(value):
                    if n == 3 and w == 0:
                        settings["model_type"] = v
            elif number == 3 and wire == 2:
                for n, w, v in _fields(value):
                    if n == 3 and w == 0:
                        settings["add_dummy_prefix"] = bool(v)
    except (ValueError, UnicodeDecodeError, struct.error) as error:
        raise ValueError(f"not a SentencePiece model: {error}") from None
    if not pieces:
        raise ValueError("not a SentencePiece model: it has no pieces")
    return pieces, settings


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def spiece_tokenizer_json(spiece: str | Path, extra_ids: int = NUM_SENTINELS) -> dict[str, Any]:
    """The tokenizers JSON equivalent to the slow ``T5Tokenizer(spiece, extra_ids=extra_ids)`` on residue input:
    the pieces at their SentencePiece ids, then ``<extra_id_{extra_ids-1}>`` .. ``<extra_id_0>`` (the last id,
    as T5 numbers sentinels); control, unknown and user-defined pieces and the sentinels as special tokens."""
    pieces, settings = read_spiece(Path(spiece).read_bytes())
    origin = Path(spiece).name
    if settings["model_type"] != 1:
        raise ValueError(f"{origin}: a Unigram SentencePiece model was expected (model_type {settings['model_type']})")
    if settings["add_dummy_prefix"]:
        raise ValueError(
            f"{origin} adds a dummy prefix: the slow T5Tokenizer would then encode every residue of "
            "is_split_into_words input as '▁' + residue, not as the residue's own piece, which ANKHTokenizer assumes"
        )
    names = [piece for piece, _, _ in pieces]
    if any(name.startswith("<extra_id_") for name in names):
        raise ValueError(f"{origin} holds sentinel pieces itself; the slow T5Tokenizer would number them twice")
    unknown = [i for i, (_, _, kind) in enumerate(pieces) if kind == _SP_UNKNOWN]
    if len(unknown) != 1:
        raise ValueError(f"{origin}: expected one unknown piece, found {len(unknown)}")
    sentinels = [f"<extra_id_{i}>" for i in reversed(range(extra_ids))]
    vocab = [[piece, score] for piece, score, _ in pieces] + [[token, 0.0] for token in sentinels]
    specials = [i for i, (_, _, kind) in enumerate(pieces) if kind in (_SP_UNKNOWN, _SP_CONTROL, _SP_USER_DEFINED)]
    specials += range(len(pieces), len(pieces) + extra_ids)
    added = [_added_token(i, vocab[i][0]) for i in specials]
    model = {"type": "Unigram", "unk_id": unknown[0], "vocab": vocab, "byte_fallback": False}
    return runtime_tokenizer_json({"version": "1.0", "added_tokens": added, "model": model})


def _official_fast(path: Path) -> PreTrainedTokenizerFast:
    # The file's own tokenizers pipeline, as transformers 4.25's T5TokenizerFast (the official v1 loader) runs it.
    return PreTrainedTokenizerFast(tokenizer_file=str(path))


def _check_official_residues(data: Mapping[str, Any], official: Path, origin: str) -> None:
    """Each residue, encoded alone by ``official`` (a snapshot tokenizer.json, with its own pipeline), must be the
    id ``data`` gives it; a leading ``▁``/``<unk>`` (a Metaspace prefix artefact) is tolerated and dropped."""
    backend = _official_fast(official).backend_tokenizer
    vocab = _vocabulary(data)
    alphabet = _residue_alphabet(vocab, (t["content"] for t in data["added_tokens"]))
    artefacts = {vocab.get("▁"), UNK_ID}
    wrong = {}
    for residue in alphabet:
        ids = backend.encode([residue], is_pretokenized=True, add_special_tokens=False).ids
        while len(ids) > 1 and ids[0] in artefacts:
            ids = ids[1:]
        if ids != [vocab[residue]]:
            wrong[residue] = (vocab[residue], ids)
    if wrong:
        raise ValueError(f"{origin}: residues encode differently in {official.name} (ours, official): {wrong}")


def _snapshot_sentinels(snapshot: Path) -> int:
    """The slow T5Tokenizer's sentinel count (``extra_ids``, 100 by default); other additional special tokens
    (which it would append as new ids) are refused."""
    config = _read_json(snapshot / "tokenizer_config.json")
    extra = config.get("extra_ids", NUM_SENTINELS)
    named = config.get("additional_special_tokens", [])
    named += _read_json(snapshot / "special_tokens_map.json").get("additional_special_tokens", [])
    contents = {t if isinstance(t, str) else t.get("content") for t in named}
    others = sorted(contents - {f"<extra_id_{i}>" for i in range(extra)})
    if others:
        raise ValueError(f"{snapshot}: additional special tokens beyond the sentinels are not supported: {others}")
    return extra


def tokenizer_files(
    directory: str | Path, snapshot: str | Path, model_max_length: int = DEFAULT_MODEL_MAX_LENGTH
) -> list[Path]:
    """Write the tokenizer files of a remote-code artifact from the official snapshot folder ``snapshot`` (the
    caller copies this module beside them): tokenizer.json, tokenizer_config.json (``auto_map`` to
    ``tokenization_ankh.ANKHTokenizer``) and special_tokens_map.json.

    The vocabulary comes from what the official loader reads: ``spiece.model`` where the snapshot has one (ANKH3:
    the slow ``T5Tokenizer``), converted to tokenizers JSON and checked id by id against the snapshot's own
    tokenizer.json when there is one; otherwise ``tokenizer.json`` (v1/v2: ``AutoTokenizer``). Either way the
    written file carries ANKHTokenizer's pipeline, every residue is checked to encode as the official tokenizer
    encodes it alone, and the vocabulary must have the T5 pad/eos/unk ids and the canonical residues.
    """
    if not isinstance(snapshot, (str, Path)):
        raise TypeError(
            f"ANKH's vocabulary comes from the official snapshot: pass its folder, not {type(snapshot).__name__}"
        )
    snapshot, directory = Path(snapshot), Path(directory)
    spiece, fast = snapshot / SPIECE_FILE, snapshot / TOKENIZER_FILE
    if spiece.is_file():
        data = spiece_tokenizer_json(spiece, _snapshot_sentinels(snapshot))
        if fast.is_file():
            official = _vocabulary(_read_json(fast))
            differ = {t: (i, official.get(t)) for t, i in _vocabulary(data).items() if official.get(t) != i}
            if differ or len(official) != len(_vocabulary(data)):
                shown = dict(list(differ.items())[:8])
                raise ValueError(
                    f"{snapshot}: {SPIECE_FILE} and {TOKENIZER_FILE} disagree ({len(differ)} tokens differ, "
                    f"(spiece, tokenizer.json) ids: {shown}; sizes {len(_vocabulary(data))} and {len(official)})"
                )
            _check_official_residues(data, fast, str(snapshot))
    elif fast.is_file():
        data = runtime_tokenizer_json(_read_json(fast))
        _check_official_residues(data, fast, str(snapshot))
    else:
        raise FileNotFoundError(f"{snapshot} has neither {SPIECE_FILE} nor {TOKENIZER_FILE}")
    vocab = _vocabulary(data)
    _check_vocabulary(vocab, _residue_alphabet(vocab, (t["content"] for t in data["added_tokens"])), str(snapshot))

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer_path = directory / TOKENIZER_FILE
    tokenizer_path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    extra = [t["content"] for t in data["added_tokens"] if t["content"] not in _SPECIAL_TOKENS.values()]
    config = {
        "tokenizer_class": ANKHTokenizer.__name__,
        # A fast class only (its backend is tokenizers): no slow counterpart, hence the null first slot.
        "auto_map": {"AutoTokenizer": [None, f"tokenization_ankh.{ANKHTokenizer.__name__}"]},
        "model_max_length": model_max_length,
        "padding_side": "right",
        "truncation_side": "right",
        "model_input_names": ANKHTokenizer.model_input_names,
        "clean_up_tokenization_spaces": False,
        "task_prefix": None,
        **_SPECIAL_TOKENS,
        "extra_special_tokens": extra,
    }
    config_path = directory / "tokenizer_config.json"
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    special = {**_SPECIAL_TOKENS, "extra_special_tokens": extra}
    special_path = directory / "special_tokens_map.json"
    special_path.write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")

    # The written files must load and encode every residue as its vocabulary id (one token each, then </s>).
    written = ANKHTokenizer(tokenizer_file=str(tokenizer_path))
    alphabet = written.residues
    if written(alphabet)["input_ids"] != [vocab[r] for r in alphabet] + [EOS_ID]:
        raise AssertionError("the written tokenizer does not encode residues as their vocabulary ids")
    return [tokenizer_path, config_path, special_path]
