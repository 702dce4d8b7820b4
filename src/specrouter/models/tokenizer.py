"""Tokenizer loading and the pool's "one shared vocabulary" check.

Speculative decoding compares the models' distributions id by id, so every model of a pool must
map the same token strings to the same ids. What may differ is the logits width: checkpoints pad
their embedding matrix (Qwen2.5-0.5B has 151936 rows, Qwen2.5-7B 152064) beyond the tokenizer.

The rule `check_same_vocabulary` enforces:
1. every tokenizer has the same `vocab_fingerprint` (token -> id map and special tokens);
2. every model's logits width is >= the number of ids the tokenizer uses (max id + 1).
Widths may then differ: ids at or past the tokenizer's size are never produced by tokenization,
and the engine compares distributions over the first `shared_vocab_size` ids (the return value).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specrouter.errors import CheckpointError, VocabularyMismatchError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Files of which a loadable tokenizer directory has at least one.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                    "sentencepiece.bpe.model", "tiktoken.model")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a Hugging Face model directory with `AutoTokenizer`, from local files
    only and never with the checkpoint's own code. Raises CheckpointError when the directory or
    its tokenizer files are missing or unreadable."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"tokenizer directory {str(path)!r} does not exist")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES) and not any(path.glob("*.tiktoken")):
        raise CheckpointError(
            f"no tokenizer files in {str(path)!r} (looked for {', '.join(_TOKENIZER_FILES)}, "
            "*.tiktoken); copy the tokenizer of the model family next to config.json"
        )
    try:
        return AutoTokenizer.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=False
        )
    except Exception as e:
        text = " ".join(str(e).split())[:300]
        raise CheckpointError(f"cannot load the tokenizer in {str(path)!r}: "
                              f"{type(e).__name__}: {text}") from e


def _special_tokens(tokenizer) -> list[tuple[int, str]]:
    """(id, text) of every token the tokenizer treats as special, sorted by id."""
    specials = {}
    for idx, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(tok, "special", False):
            specials[int(idx)] = str(tok)
    for text, idx in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids):
        if idx is not None:
            specials[int(idx)] = str(text)
    return sorted(specials.items())


def vocab_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A stable hex SHA-256 of the token -> id map (added tokens included) and of the set of
    special tokens (id, text). It ignores which special token plays bos/eos/pad: base and
    instruct variants of a family differ there (SmolLM2's eos is <|endoftext|> vs <|im_end|>)
    and still share one vocabulary; the target's eos ids govern stopping."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0])),
        "special": _special_tokens(tokenizer),
    }
    blob = json.dumps(payload, ensure_ascii=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def _describe_difference(ref_name: str, ref, name: str, other) -> str:
    """One line saying how `other`'s vocabulary differs from `ref`'s."""
    a, b = ref.get_vocab(), other.get_vocab()
    only_ref = [t for t in a if t not in b]
    only_other = [t for t in b if t not in a]
    moved = sorted((t for t in a if t in b and a[t] != b[t]), key=lambda t: a[t])
    parts = [f"{ref_name!r} has {len(a)} tokens, {name!r} {len(b)}"]
    if moved:
        t = moved[0]
        parts.append(f"{len(moved)} tokens map to different ids (e.g. {t!r}: {a[t]} vs {b[t]})")
    if only_ref:
        parts.append(f"{len(only_ref)} only in {ref_name!r} (e.g. {only_ref[0]!r})")
    if only_other:
        parts.append(f"{len(only_other)} only in {name!r} (e.g. {only_other[0]!r})")
    if not (moved or only_ref or only_other):
        sa, sb = dict(_special_tokens(ref)), dict(_special_tokens(other))
        parts.append(f"same token map but different special tokens ({sa} vs {sb})")
    return "; ".join(parts)


def check_same_vocabulary(
    named_tokenizers: dict[str, Any], named_vocab_sizes: dict[str, int]
) -> int:
    """Check that a pool shares one vocabulary (module docstring: the rule); return the shared
    vocabulary size, max token id + 1, which every model's logits width covers.

    named_tokenizers: model name -> tokenizer (the first entry is the reference the others are
    described against: put the target first). named_vocab_sizes: model name -> logits width.
    Raises VocabularyMismatchError naming the models that differ and how.
    """
    if not named_tokenizers:
        raise ValueError("check_same_vocabulary needs at least one tokenizer")
    names = list(named_tokenizers)
    prints = {n: vocab_fingerprint(named_tokenizers[n]) for n in names}
    ref = names[0]
    differ = [n for n in names if prints[n] != prints[ref]]
    if differ:
        same = [n for n in names if prints[n] == prints[ref]]
        details = "\n".join(
            f"  - {_describe_difference(ref, named_tokenizers[ref], n, named_tokenizers[n])}"
            for n in differ
        )
        raise VocabularyMismatchError(
            f"models {differ} do not share the tokenizer of {same}; speculative decoding needs "
            f"one vocabulary across the pool:\n{details}"
        )
    ids = named_tokenizers[ref].get_vocab().values()
    shared = max(ids) + 1 if ids else 0
    too_small = {n: w for n, w in named_vocab_sizes.items() if w < shared}
    if too_small:
        raise VocabularyMismatchError(
            f"models {sorted(too_small)} have logits widths {too_small}, smaller than the shared "
            f"tokenizer's {shared} ids (padded widths may differ, but every id must fit every "
            "model); the tokenizer and the weights are of different models"
        )
    return shared


def eos_token_ids(
    tokenizer: PreTrainedTokenizerBase, model_dir: str | Path | None
) -> tuple[int, ...]:
    """The ids that end generation: the tokenizer's eos_token_id first, then those of the model's
    generation_config.json (`eos_token_id`, an int or a list; instruct models often list several,
    e.g. <|im_end|> and <|endoftext|>), without repeats. `model_dir=None` or no
    generation_config.json: the tokenizer's only. Raises CheckpointError if the file is corrupt."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen_path = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if gen_path is not None and gen_path.is_file():
        try:
            value = json.loads(gen_path.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as e:
            raise CheckpointError(f"cannot read {str(gen_path)!r}: {type(e).__name__}: {e}") from e
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                ids.append(v)
            elif v is not None:
                raise CheckpointError(f"{str(gen_path)!r}: eos_token_id {value!r} is not an int "
                                      "or a list of ints")
    return tuple(dict.fromkeys(ids))


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict], *,
                        add_generation_prompt: bool = True, template: str | None = None,
                        template_kwargs: dict | None = None,
                        add_special_tokens: bool = False) -> list[int]:
    """Render `messages` ([{"role": ..., "content": ...}, ...]) with the tokenizer's chat template
    (or `template`, a Jinja template that replaces it: `serve --chat-template FILE`), with the
    assistant generation prompt appended (as OpenAI-style chat endpoints do) unless
    `add_generation_prompt` is false, `template_kwargs` as extra template variables (vLLM's
    `chat_template_kwargs`), and tokenize it without adding special tokens again (the template
    writes them) unless `add_special_tokens`.

    Raises CheckpointError if there is no template (a base model: send a raw prompt to
    /v1/completions instead), ValueError if `messages` is malformed."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise CheckpointError(
            "this tokenizer has no chat template (no chat_template in tokenizer_config.json or "
            "chat_template.jinja); it is likely a base model: use a plain prompt (completions) "
            "or a chat/instruct checkpoint"
        )
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content', "
                             f"got {m!r}")
    kwargs = dict(template_kwargs or {})
    for reserved in ("messages", "conversation", "tokenize", "add_generation_prompt",
                     "chat_template", "return_dict"):
        if reserved in kwargs:
            raise ValueError(f"chat_template_kwargs may not set {reserved!r}")
    text = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template,
                                         add_generation_prompt=add_generation_prompt, **kwargs)
    return text_encoder(tokenizer)(text, add_special_tokens)


def text_encoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[str, bool], list[int]]:
    """`(text, add_special_tokens) -> tokenizer(text, add_special_tokens=...)["input_ids"]`, with
    less work where that is the same: a fast tokenizer whose Rust tokenizer truncates and pads
    nothing and keeps special tokens whole (transformers' own call settings then change nothing) is
    called directly, one `encode` (transformers' call wraps an `encode_batch` of one text in ~20 us
    of Python: 36 -> 19 us for a 60-character prompt on a Sapphire Rapids, about twice that on a
    loop whose caches a decode step just flushed; the server tokenizes short prompts on its event
    loop). Any other tokenizer goes through `tokenizer(...)`."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if (backend is None or backend.truncation is not None or backend.padding is not None
            or getattr(tokenizer, "split_special_tokens", False) or backend.encode_special_tokens):
        return lambda text, add_special_tokens=False: list(
            tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def encode(text: str, add_special_tokens: bool = False) -> list[int]:
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    return encode


__all__ = [
    "IncrementalDecoder",
    "apply_chat_template",
    "check_same_vocabulary",
    "eos_token_ids",
    "load_tokenizer",
    "text_decoder",
    "text_encoder",
    "vocab_fingerprint",
]


def text_decoder(tokenizer: PreTrainedTokenizerBase) -> tuple[Callable[[list[int]], str], bool]:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=True)`, the same text with less work, and
    whether that decode JOINS: decode(a + b) == decode(a) + decode(b) whenever decode(a) ends on
    a whole character (not U+FFFD).

    - A fast tokenizer that cleans up no spaces (`clean_up_tokenization_spaces` false: SmolLM2,
      Llama 3, Qwen2) is decoded by its Rust tokenizer directly: transformers' `decode` is that
      one call wrapped in Python that costs ~3x the call itself (docs/serving-performance.md,
      ninth round). Any other tokenizer goes through `tokenizer.decode`.
    - A byte-level decoder (GPT-2's `ByteLevel`, as SmolLM2, Llama 3, Qwen2) joins: it maps every
      token to its bytes, concatenates them and reads them as UTF-8 left to right, an invalid
      sequence becoming U+FFFD, so where the first part ends on a whole character the reading of
      the rest starts afresh. A SentencePiece-style decoder does not (it strips the leading
      space of whatever comes first), nor one that puts spaces between tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return functools.partial(tokenizer.decode, skip_special_tokens=True), False
    from tokenizers import decoders

    return functools.partial(backend.decode, skip_special_tokens=True), isinstance(backend.decoder, decoders.ByteLevel)


class IncrementalDecoder:
    """The text of a growing list of token ids, as deltas, in time linear in the output:
    `add(ids)` returns the new text, holding back a trailing U+FFFD (the first bytes of a
    character split across tokens) until the rest arrives; `finish()` returns what was held
    back.

    Each `add` decodes only a window, as vLLM's and transformers' incremental detokenizers do:
    the tokens since the last stable offset `read` (where the text ended on a whole character),
    decoded together with the tokens of the step before (`prefix:read`) and minus that step's own
    decode. Both decodes start at the same token, so a decoder that changes the first token's
    text (SentencePiece drops its leading space) changes both alike, and the delta is the full
    decode's. A decoder that joins (`text_decoder`: byte-level BPE) needs no step before: its
    window starts at `read`, one decode an `add` instead of two. `text` is the final text so far
    (of `token_ids[:read]`); `pending` what follows it for now (it may end in U+FFFD, or change
    when more tokens come)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self._decode, self._joins = text_decoder(tokenizer)
        self.token_ids: list[int] = []
        self.text = ""  # final text: the decode of token_ids[:read]
        self.pending = ""  # the text of token_ids[read:] for now
        self._prefix = 0  # the window starts here (a token that starts a whole character)
        self._read = 0  # text covers the tokens before this
        self._prefix_text = ""  # decode(token_ids[prefix:read]) ("" when the decoder joins)

    def extend(self, token_ids: list[int]) -> str:
        """Append tokens; returns the text that became final (added to `text`)."""
        self.token_ids.extend(token_ids)
        window = self._decode(self.token_ids[self._prefix:])
        if not window.startswith(self._prefix_text):  # not prefix-stable (unusual tokenizer):
            self.pending = ""                          # wait for the tokens to settle
            return ""
        tail = window[len(self._prefix_text):]
        if not tail or tail.endswith("\ufffd"):  # nothing yet, or a character still split
            self.pending = tail
            return ""
        self.text += tail
        self.pending = ""
        if self._joins:  # the next window starts where this text ends
            self._prefix = self._read = len(self.token_ids)
        else:
            self._prefix, self._read = self._read, len(self.token_ids)
            self._prefix_text = self._decode(self.token_ids[self._prefix:self._read])
        return tail

    def add(self, token_ids: list[int]) -> str:
        return self.extend(token_ids)

    def finish(self) -> str:
        """What was held back (a split character's U+FFFD when the output ended inside it)."""
        rest, self.pending = self.pending, ""
        self.text += rest
        return rest
