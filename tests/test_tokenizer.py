"""Tokenizer loading, the shared-vocabulary check, eos ids and the chat template."""

from __future__ import annotations

import json

import pytest
from fixtures import make_tiny_tokenizer

from specrouter.errors import CheckpointError, VocabularyMismatchError
from specrouter.models.tokenizer import (
    apply_chat_template,
    check_same_vocabulary,
    eos_token_ids,
    load_tokenizer,
    text_encoder,
    vocab_fingerprint,
)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for name, size in [("a", 320), ("a_copy", 320), ("small", 300)]:
        out[name] = root / name
        make_tiny_tokenizer(out[name], size)
    return out


@pytest.fixture(scope="module")
def toks(dirs):
    return {name: load_tokenizer(d) for name, d in dirs.items()}


def test_load_tokenizer_errors(dirs, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no tokenizer files"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "tokenizer.json").write_text("{ truncated")
    with pytest.raises(CheckpointError, match="cannot load the tokenizer"):
        load_tokenizer(tmp_path / "corrupt")


def test_fingerprint(toks):
    fp = vocab_fingerprint(toks["a"])
    assert len(fp) == 64 and fp == vocab_fingerprint(toks["a_copy"])
    assert fp != vocab_fingerprint(toks["small"])


def test_fingerprint_ignores_special_roles_but_not_specials(dirs):
    role = load_tokenizer(dirs["a"])
    role.eos_token = "<|im_end|>"  # an instruct variant: same vocabulary, other eos
    assert vocab_fingerprint(role) == vocab_fingerprint(load_tokenizer(dirs["a"]))
    extra = load_tokenizer(dirs["a"])
    extra.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    assert vocab_fingerprint(extra) != vocab_fingerprint(role)


def test_check_same_vocabulary(toks):
    same = {"target": toks["a"], "draft": toks["a_copy"]}
    # padded logits widths may differ as long as every tokenizer id fits
    assert check_same_vocabulary(same, {"target": 384, "draft": 320}) == 320
    with pytest.raises(VocabularyMismatchError, match=r"\['draft'\].*320 ids"):
        check_same_vocabulary(same, {"target": 320, "draft": 300})
    mixed = {"target": toks["a"], "draft": toks["a_copy"], "odd": toks["small"]}
    with pytest.raises(VocabularyMismatchError) as err:
        check_same_vocabulary(mixed, {"target": 320, "draft": 320, "odd": 300})
    msg = str(err.value)
    assert "['odd'] do not share the tokenizer of ['target', 'draft']" in msg
    assert "'target' has 320 tokens, 'odd' 300" in msg and "only in 'target'" in msg


def test_eos_token_ids(toks, tmp_path):
    tok = toks["a"]  # eos <|endoftext|> = 0
    assert eos_token_ids(tok, None) == (0,)
    assert eos_token_ids(tok, tmp_path) == (0,)  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert eos_token_ids(tok, tmp_path) == (0, 2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert eos_token_ids(tok, tmp_path) == (0, 2)
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="generation_config.json"):
        eos_token_ids(tok, tmp_path)


def test_apply_chat_template(dirs):
    tok = load_tokenizer(dirs["a"])
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = apply_chat_template(tok, messages)
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.decode(ids) == text
    with pytest.raises(ValueError, match="messages"):
        apply_chat_template(tok, [])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        apply_chat_template(tok, [{"role": "user"}])
    tok.chat_template = None
    with pytest.raises(CheckpointError, match="no chat template"):
        apply_chat_template(tok, messages)


TEXTS = ["", "hello world", "  two  spaces ", "<|im_start|>user\nhi<|im_end|>\n", "caf\u00e9 \u4f60\u597d \U0001f600",
         "line\nbreaks\tand tabs", "x" * 300]


def test_text_encoder_is_the_tokenizers_call(dirs):
    """`text_encoder` (the server's and `apply_chat_template`'s encode): the Rust tokenizer called
    directly gives `tokenizer(text, add_special_tokens=...)["input_ids"]` exactly, with and
    without special tokens added (a BOS post-processor here); a tokenizer whose Rust side
    truncates goes through `tokenizer(...)` (whose call settings turn the truncation off)."""
    from tokenizers import processors

    tok = load_tokenizer(dirs["a"])
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    encode = text_encoder(tok)
    calls = []
    real = type(tok).__call__
    for add in (False, True):
        for text in TEXTS:
            assert encode(text, add) == tok(text, add_special_tokens=add)["input_ids"], (text, add)
    assert encode("hi", True)[0] == bos and encode("hi", False)[0] != bos

    tok.backend_tokenizer.enable_truncation(4)
    slow = text_encoder(tok)
    type(tok).__call__ = lambda self, *a, **k: calls.append(a) or real(self, *a, **k)
    try:
        assert slow("x" * 300, False) == tok("x" * 300, add_special_tokens=False)["input_ids"]
        assert len(slow("x" * 300, False)) > 4 and calls  # not truncated: through the tokenizer's call
    finally:
        type(tok).__call__ = real
