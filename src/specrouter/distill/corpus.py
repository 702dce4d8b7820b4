"""The distillation corpus: offline text plus the target's own next-token distributions.

A corpus is a directory of shards. Every row is a token window of at most `seq_len` tokens with,
at every position t, the target's top-k next-token log-probabilities given tokens[:t+1]
(temperature 1, normalised over the full vocabulary, so the mass outside the top k is known).
Two kinds of rows, all offline:

- generated: the target continues varied prompts (raw code, raw prose, chat through its chat
  template, Q&A), greedily or sampled, in batches. Two prompt sets: "v1" (this module's
  templates: one-turn chats from 12 asks) and "v2" (prompts_v2.py: system prompts, multi-turn
  chats, many kinds of ask and registers, wider prose / code / Q&A forms). The distributions come for free from the
  generation forwards, so a generated token costs one decode step of the target.
- natural: windows of Python standard-library sources (tests skipped) and of /usr/share/doc
  text, labelled by one teacher forward per window.

Rows are split train / eval by prompt (generated) or by file (natural), so held-out rows share
no file with training rows. Shards are written as they are finished: an interrupted build
resumes where it stopped. The teacher's top-k distributions are computed once and reused for
every epoch and every student trained on the corpus.
"""

from __future__ import annotations

import gzip
import hashlib
import inspect
import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from specrouter.distill import prompts_v2, prompts_v2_raw
from specrouter.errors import SpecRouterError

# source -> kind; kinds are what the report breaks agreement down by
SOURCES = {
    "gen-code": "code",
    "gen-prose": "prose",
    "gen-chat": "chat",
    "gen-qa": "chat",
    "stdlib": "code",
    "docs": "prose",
}
SOURCE_IDS = {name: i for i, name in enumerate(SOURCES)}
GEN_MIX = {"gen-code": 0.35, "gen-prose": 0.3, "gen-chat": 0.25, "gen-qa": 0.1}  # prompts "v1"
# "v2" leans to chat, the kind real traffic is and the v1 draft agrees with least, and keeps v1's
# code share (session 27: a v2 corpus with 0.25 code lost code agreement, docs/drafts.md)
GEN_MIX_V2 = {"gen-code": 0.35, "gen-prose": 0.15, "gen-chat": 0.4, "gen-qa": 0.1}
PROMPT_SETS = ("v1", "v2")
NATURAL_MIX = {"stdlib": 0.75, "docs": 0.25}
SHARD_ROWS = 128  # rows per shard (= one generation batch)
CORPUS_VERSION = 1

# ---------------------------------------------------------------------------------------------
# Prompts


_TOPICS = (
    "the water cycle", "black holes", "the French Revolution", "photosynthesis",
    "machine learning", "the stock market", "climate change", "the human heart", "volcanoes",
    "the Roman Empire", "honey bees", "the internet", "renewable energy", "the Moon landing",
    "coffee", "chess", "the immune system", "electric cars", "ancient Egypt", "jazz music",
    "the printing press", "earthquakes", "the Great Wall of China", "vaccines", "democracy",
    "the solar system", "recycling", "the Industrial Revolution", "dinosaurs", "sleep",
    "the ocean", "artificial intelligence", "the Renaissance", "rainforests", "gravity",
    "public libraries", "bicycles", "the Olympic Games", "inflation", "DNA", "the piano",
    "social media", "tea", "mountains", "the speed of light", "friendship", "time management",
    "healthy eating", "the history of mathematics", "trains", "bread baking", "glaciers",
)
_THINGS = (
    "a lost robot", "a lighthouse keeper", "a dragon who loves books", "a small village",
    "a rainy day in the city", "a cat and a dog", "the first day of school", "an old clock",
    "a journey to Mars", "a forgotten garden", "a brave knight", "the last tree on Earth",
)
_TASKS = (
    "reverse a string", "check if a number is prime", "compute the factorial of n",
    "merge two sorted lists", "count word frequencies in a text", "find the maximum of a list",
    "implement binary search", "remove duplicates from a list", "validate an email address",
    "flatten a nested list", "compute Fibonacci numbers", "parse a JSON string",
    "sort a dictionary by value", "convert Celsius to Fahrenheit", "implement a stack",
    "read a CSV file and sum a column", "check if a string is a palindrome",
    "compute the greatest common divisor", "transpose a matrix", "count vowels in a string",
    "find the second largest number", "implement a linked list", "compute the mean and median",
    "generate all permutations of a list", "convert a number to binary", "implement bubble sort",
    "find common elements of two lists", "capitalize every word in a sentence",
    "compute the area of a circle", "implement a simple calculator", "group words by anagram",
)
_ACTIVITIES = (
    "learning a new language", "studying for exams", "running a marathon", "saving money",
    "writing a good essay", "staying focused", "cooking pasta", "taking better photos",
    "starting a garden", "public speaking", "learning to code", "traveling on a budget",
)


def _snake(task: str) -> str:
    return "_".join(w for w in task.lower().replace("-", " ").split() if w.isalnum())[:40]


def _code_prompt(rng: random.Random, snippets: list[str]) -> str:
    task = rng.choice(_TASKS)
    forms = [
        lambda: f"def {_snake(task)}(",
        lambda: f'def {_snake(task)}(data):\n    """{task.capitalize()}."""\n',
        lambda: f"# {task.capitalize()}\n",
        lambda: f"# Python program to {task}\n\n",
        lambda: f"```python\n# {task}\n",
        lambda: f"import {rng.choice(['os', 'sys', 'math', 'json', 're', 'random'])}\n\n\n",
        lambda: f"class {''.join(w.capitalize() for w in _snake(task).split('_'))[:30]}:\n",
        lambda: f"// {task.capitalize()} in JavaScript\nfunction ",
        lambda: f"/* {task.capitalize()} in C */\n#include <stdio.h>\n\n",
    ]
    if snippets and rng.random() < 0.4:
        return rng.choice(snippets)
    return rng.choice(forms)()


def _prose_prompt(rng: random.Random, snippets: list[str]) -> str:
    topic = rng.choice(_TOPICS)
    forms = [
        lambda: f"{topic[0].upper()}{topic[1:]} is",
        lambda: f"The history of {topic}",
        lambda: f"In this article, we will discuss {topic}.",
        lambda: f"{topic[0].upper()}{topic[1:]}: an introduction\n\n",
        lambda: "Once upon a time, " + rng.choice(_THINGS),
        lambda: f"Chapter 1\n\n{rng.choice(_THINGS).capitalize()}",
        lambda: f"Here are some interesting facts about {topic}:\n\n1.",
        lambda: f"Many people wonder why {topic}",
    ]
    if snippets and rng.random() < 0.25:
        return rng.choice(snippets)
    return rng.choice(forms)()


def _chat_messages(rng: random.Random) -> list[dict]:
    topic, thing, task = rng.choice(_TOPICS), rng.choice(_THINGS), rng.choice(_TASKS)
    asks = [
        f"Explain {topic} in simple terms.", f"Write a short story about {thing}.",
        f"What is {topic}?", f"Write a Python function to {task}.",
        f"How do I {task} in Python?", f"Give me three tips for {rng.choice(_ACTIVITIES)}.",
        f"Write a poem about {topic}.", f"Summarize the history of {topic} in a paragraph.",
        f"Can you help me understand {topic}?", f"What are the pros and cons of {topic}?",
        f"Write an email to my team about {topic}.", f"List five facts about {topic}.",
    ]
    return [{"role": "user", "content": rng.choice(asks)}]


def _qa_prompt(rng: random.Random) -> str:
    topic = rng.choice(_TOPICS)
    return rng.choice([
        f"Question: What is {topic}?\nAnswer:",
        f"Q: Why is {topic} important?\nA:",
        f"Q: How does {topic} work?\nA:",
        f"Question: Who studies {topic}, and why?\nAnswer:",
    ])


# ---------------------------------------------------------------------------------------------
# Offline natural text


def stdlib_files() -> list[Path]:
    """The running interpreter's standard-library .py files, test suites skipped. Sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    return sorted(
        p for p in root.rglob("*.py")
        if not skip.intersection(p.relative_to(root).parts) and not p.name.startswith("test_")
    )


def doc_files(root: str | Path = "/usr/share/doc") -> list[Path]:
    """Prose-like files under /usr/share/doc (READMEs, .txt/.md/.rst, gzipped or not), without
    changelogs and copyright files. Empty when the folder is absent. Sorted."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.rglob("*"):
        name = p.name.lower().removesuffix(".gz")
        if "changelog" in name or "copyright" in name or not p.is_file():
            continue
        if name.startswith("readme") or name.endswith((".txt", ".md", ".rst", ".markdown")):
            out.append(p)
    return sorted(out)


def read_text(path: Path, limit: int = 200_000) -> str:
    """A text file (gzip allowed), at most `limit` characters; '' for binary or unreadable."""
    try:
        raw = gzip.open(path).read(limit) if path.suffix == ".gz" else path.read_bytes()[:limit]
    except (OSError, EOFError):
        return ""
    if b"\x00" in raw:
        return ""
    return raw.decode("utf-8", errors="ignore")


def _is_eval(key: str, eval_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha1(key.encode()).digest()[:4], "little")
    return h % 10_000 < eval_fraction * 10_000


def _code_snippets(files: list[Path], rng: random.Random, n: int = 400) -> list[str]:
    """Openings of functions and classes from (training) stdlib files: real-code prompts."""
    out: list[str] = []
    for path in rng.sample(files, min(len(files), n)):
        lines = read_text(path).splitlines()
        starts = [i for i, l in enumerate(lines) if l.lstrip().startswith(("def ", "class "))]
        if starts:
            i = rng.choice(starts)
            out.append("\n".join(lines[i : i + rng.randint(1, 6)]) + "\n")
    return out


def _prose_snippets(files: list[Path], rng: random.Random, n: int = 200) -> list[str]:
    out: list[str] = []
    for path in rng.sample(files, min(len(files), n)):
        paras = [p.strip() for p in read_text(path, 20_000).split("\n\n") if len(p.strip()) > 80]
        if paras:
            out.append(rng.choice(paras)[:300])
    return out


# ---------------------------------------------------------------------------------------------
# Teacher labelling


def _cache_kw(model) -> str:
    """transformers 5.x renamed forward(past_key_values=) to forward(cache=)."""
    params = inspect.signature(model.model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def topk_logprobs(model, hidden: torch.Tensor, k: int, chunk: int = 256):
    """Top-k next-token log-probabilities (temperature 1, full-vocabulary normalisation) from
    final hidden states (N, D). Returns ids (N, k) int32 and logp (N, k) float16, sorted."""
    ids = torch.empty(hidden.shape[0], k, dtype=torch.int32)
    logp = torch.empty(hidden.shape[0], k, dtype=torch.float16)
    for s in range(0, hidden.shape[0], chunk):
        logits = model.lm_head(hidden[s : s + chunk]).float()  # (c, V)
        v, i = torch.log_softmax(logits, -1).topk(k, -1)
        ids[s : s + chunk], logp[s : s + chunk] = i.int(), v.half()
    return ids, logp


@torch.no_grad()
def label_rows(model, rows: list[list[int]], k: int, batch: int = 8):
    """Teacher top-k distributions at every position of each row (one forward per batch of
    right-padded rows; causal attention makes the padding irrelevant)."""
    out = []
    for s in range(0, len(rows), batch):
        part = rows[s : s + batch]
        T = max(len(r) for r in part)
        ids = torch.zeros(len(part), T, dtype=torch.long)
        for b, r in enumerate(part):
            ids[b, : len(r)] = torch.tensor(r)
        hidden = model.model(input_ids=ids).last_hidden_state  # (B, T, D)
        top_ids, top_logp = topk_logprobs(model, hidden.reshape(-1, hidden.shape[-1]), k)
        top_ids, top_logp = top_ids.view(len(part), T, k), top_logp.view(len(part), T, k)
        out += [(top_ids[b, : len(r)], top_logp[b, : len(r)]) for b, r in enumerate(part)]
    return out


@torch.no_grad()
def generate_rows(
    model,
    prompts: list[list[int]],
    greedy: list[bool],
    *,
    max_len: int,
    k: int,
    temperature: float,
    stop_ids: set[int],
    generator: torch.Generator,
    min_active: float = 0.25,
):
    """Batched generation by the target with a static KV cache; every row is its prompt plus
    what the target wrote (up to and including a stop token), with the target's top-k
    distribution at every position but the last. Rows decode greedily or sample at
    `temperature` from the top k. The batch stops when fewer than `min_active` of its rows are
    still going (the others are kept, shorter)."""
    from transformers import StaticCache

    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, P, dtype=torch.long)
    mask = torch.zeros(B, max_len, dtype=torch.long)  # left-padded prompts, then generated
    for b, p in enumerate(prompts):
        ids[b, P - len(p) :] = torch.tensor(p)
        mask[b, P - len(p) :] = 1
    pos = (mask[:, :P].cumsum(-1) - 1).clamp(min=0)  # (B, P) per-row positions
    cache = {_cache_kw(model): StaticCache(config=model.config, max_cache_len=max_len)}
    hidden = model.model(
        input_ids=ids, attention_mask=mask[:, :P], position_ids=pos,
        **cache, use_cache=True, cache_position=torch.arange(P),
    ).last_hidden_state  # (B, P, D)
    top_ids, top_logp = topk_logprobs(model, hidden.reshape(B * P, -1), k)
    top_ids, top_logp = top_ids.view(B, P, k), top_logp.view(B, P, k)
    rows = [list(p) for p in prompts]
    labels = [([top_ids[b, P - len(p) :]], [top_logp[b, P - len(p) :]]) for b, p in enumerate(prompts)]
    greedy_t = torch.tensor(greedy)
    active = torch.ones(B, dtype=torch.bool)
    last_ids, last_logp = top_ids[:, -1], top_logp[:, -1]  # (B, k): distribution of the next token
    pos = pos[:, -1:]
    for t in range(P, max_len):
        # 1. choose the next token: argmax, or a sample from the top k at `temperature`
        probs = torch.softmax(last_logp.float() / temperature, -1)
        pick = torch.multinomial(probs, 1, generator=generator)[:, 0]
        pick = torch.where(greedy_t, torch.zeros_like(pick), pick)
        nxt = last_ids.gather(1, pick[:, None])[:, 0].long()  # (B,)
        for b in active.nonzero()[:, 0].tolist():
            rows[b].append(int(nxt[b]))
            if int(nxt[b]) in stop_ids:
                active[b] = False
        if active.sum() < max(1, min_active * B) or t == max_len - 1:
            break
        # 2. one decode step of the target gives the distribution after the new token
        mask[:, t] = 1
        pos = pos + 1
        hidden = model.model(
            input_ids=nxt[:, None], attention_mask=mask[:, : t + 1], position_ids=pos,
            **cache, use_cache=True, cache_position=torch.tensor([t]),
        ).last_hidden_state[:, 0]  # (B, D)
        last_ids, last_logp = topk_logprobs(model, hidden, k)
        for b in active.nonzero()[:, 0].tolist():
            labels[b][0].append(last_ids[b : b + 1])
            labels[b][1].append(last_logp[b : b + 1])
    # a row of L tokens has labels for positions 0..L-2 (its last token has no next token)
    out = []
    for b in range(B):
        i, lp = torch.cat(labels[b][0]), torch.cat(labels[b][1])
        n = len(rows[b]) - 1
        out.append((rows[b], i[:n], lp[:n]))
    return out


# ---------------------------------------------------------------------------------------------
# The corpus directory


@dataclass(frozen=True)
class CorpusSpec:
    """What a corpus is made of; a cached corpus is reused only if its spec is equal."""

    target: str  # the target checkpoint (path as given; recorded, not compared)
    vocab_size: int
    corpus_tokens: int  # label positions, train + eval
    generated_fraction: float  # share of positions from target generations
    seq_len: int  # tokens per row at most
    teacher_topk: int  # k of the cached top-k distributions
    temperature: float  # sampling temperature of the non-greedy generated rows
    greedy_fraction: float  # share of generated rows decoded greedily
    eval_fraction: float  # share of prompts / files held out
    seed: int
    version: int = CORPUS_VERSION
    # the prompt set of the generated rows; a spec.json written before v2 existed reads as "v1"
    prompts: str = "v1"

    def __post_init__(self) -> None:
        if self.prompts not in PROMPT_SETS:
            raise SpecRouterError(f"prompts must be one of {PROMPT_SETS}, got {self.prompts!r}")


class Corpus:
    """A finished corpus loaded in memory: padded rows with their teacher labels."""

    ROW_FIELDS = ("tokens", "lengths", "topk_ids", "topk_logp", "source", "is_eval")  # (R, ...) each

    def __init__(self, shards: list[dict]):
        cat = lambda key: torch.cat([s[key] for s in shards])  # noqa: E731
        self.tokens = cat("tokens")  # (R, T) int64, right-padded with 0
        self.lengths = cat("lengths")  # (R,) int64: tokens per row
        self.topk_ids = cat("topk_ids")  # (R, T, k) int32
        self.topk_logp = cat("topk_logp")  # (R, T, k) float16
        self.source = cat("source")  # (R,) int64: index into SOURCES
        self.is_eval = cat("is_eval")  # (R,) bool

    @staticmethod
    def merge(corpora: list["Corpus"]) -> "Corpus":
        """One corpus with the rows of all (same seq_len and teacher k)."""
        merged = Corpus.__new__(Corpus)
        for key in Corpus.ROW_FIELDS:
            setattr(merged, key, torch.cat([getattr(c, key) for c in corpora]))
        return merged

    def decontaminate(self, prefix: int = 64) -> int:
        """Drop training rows that start like a held-out row (same first `prefix` tokens): two
        corpora built with other seeds can draw the same templated prompt, one for training and
        one for evaluation. Returns the number of rows dropped."""
        n = min(prefix, self.tokens.shape[1])
        held = {tuple(r) for r in self.tokens[self.is_eval, :n].tolist()}
        drop = torch.tensor([not e and tuple(r) in held
                             for r, e in zip(self.tokens[:, :n].tolist(), self.is_eval.tolist())])
        if bool(drop.any()):
            for key in Corpus.ROW_FIELDS:
                setattr(self, key, getattr(self, key)[~drop])
        return int(drop.sum())

    def label_mask(self, rows: torch.Tensor) -> torch.Tensor:
        """(B, T) bool: positions of `rows` that carry a label (all but each row's last)."""
        T = self.tokens.shape[1]
        return torch.arange(T)[None, :] < (self.lengths[rows] - 1)[:, None]

    def composition(self) -> dict:
        """Rows and label positions per source and split (recorded in recipe.json)."""
        out = {}
        for name, sid in SOURCE_IDS.items():
            sel = self.source == sid
            if not bool(sel.any()):
                continue
            pos = (self.lengths - 1).clamp(min=0)
            out[name] = {
                "kind": SOURCES[name],
                "train_rows": int((sel & ~self.is_eval).sum()),
                "eval_rows": int((sel & self.is_eval).sum()),
                "train_tokens": int(pos[sel & ~self.is_eval].sum()),
                "eval_tokens": int(pos[sel & self.is_eval].sum()),
            }
        return out


def _pack(rows, seq_len: int, k: int, source: list[int], is_eval: list[bool]) -> dict:
    R = len(rows)
    shard = {
        "tokens": torch.zeros(R, seq_len, dtype=torch.long),
        "lengths": torch.tensor([len(r[0]) for r in rows], dtype=torch.long),
        "topk_ids": torch.zeros(R, seq_len, k, dtype=torch.int32),
        "topk_logp": torch.full((R, seq_len, k), -100.0, dtype=torch.float16),
        "source": torch.tensor(source, dtype=torch.long),
        "is_eval": torch.tensor(is_eval, dtype=torch.bool),
    }
    for b, (toks, ids, logp) in enumerate(rows):
        shard["tokens"][b, : len(toks)] = torch.tensor(toks)
        shard["topk_ids"][b, : len(ids)] = ids
        shard["topk_logp"][b, : len(ids)] = logp
    return shard


def _stop_ids(tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id}
    for tok in ("<|im_end|>", "<|endoftext|>", "</s>"):
        i = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(i, int) and i != tokenizer.unk_token_id:
            ids.add(i)
    return {i for i in ids if i is not None}


def _natural_windows(tokenizer, spec: CorpusSpec, rng: random.Random) -> Iterator[tuple]:
    """Endless stream of (source, tokens, is_eval): up to two windows per file, sources
    interleaved by NATURAL_MIX, files in seeded random order."""
    pools = {"stdlib": stdlib_files(), "docs": doc_files()}
    for files in pools.values():
        rng.shuffle(files)
    names = [n for n in NATURAL_MIX if pools[n]]
    if not names:
        return
    cursor = {n: 0 for n in names}
    while True:
        name = rng.choices(names, [NATURAL_MIX[n] for n in names])[0]
        files = pools[name]
        path = files[cursor[name] % len(files)]
        cursor[name] += 1
        toks = tokenizer(read_text(path), add_special_tokens=False)["input_ids"]
        if len(toks) < 32:
            continue
        is_eval = _is_eval(str(path), spec.eval_fraction)
        starts = [0] if len(toks) <= spec.seq_len else rng.sample(
            range(len(toks) - spec.seq_len + 1), min(2, len(toks) - spec.seq_len + 1))
        for s in starts:
            yield name, toks[s : s + spec.seq_len], is_eval


def _chat_ids(tokenizer, messages: list[dict], max_prompt: int) -> list[int]:
    """A chat through the chat template, its earliest exchanges after the system prompt dropped
    while it is over `max_prompt` tokens (then, if still over, its start cut)."""
    while True:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        first = 1 if messages[0]["role"] == "system" else 0
        if len(ids) <= max_prompt or len(messages) - first < 3:
            return ids[-max_prompt:]
        messages = messages[:first] + messages[first + 2:]


def _prompt_stream(tokenizer, spec: CorpusSpec, rng: random.Random) -> Iterator[tuple]:
    """Endless stream of (source, prompt token ids, greedy, is_eval)."""
    code = _code_snippets([p for p in stdlib_files() if not _is_eval(str(p), spec.eval_fraction)], rng)
    prose = _prose_snippets(doc_files(), rng)
    v2 = spec.prompts == "v2"
    mix = GEN_MIX_V2 if v2 else GEN_MIX
    # v2 chats carry system prompts, earlier turns and pasted passages: room for them
    max_prompt = max(8, spec.seq_len // (2 if v2 else 4))
    n = 0
    while True:
        name = rng.choices(list(mix), list(mix.values()))[0]
        if name == "gen-chat":
            messages = prompts_v2.chat_messages(rng)[1] if v2 else _chat_messages(rng)
            ids = _chat_ids(tokenizer, messages, max_prompt)
        else:
            if name == "gen-code":
                text = (prompts_v2_raw.code_prompt if v2 else _code_prompt)(rng, code)
            elif name == "gen-prose":
                text = (prompts_v2_raw.prose_prompt if v2 else _prose_prompt)(rng, prose)
            else:
                text = (prompts_v2_raw.qa_prompt if v2 else _qa_prompt)(rng)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][-max_prompt:]
        n += 1
        yield name, ids, rng.random() < spec.greedy_fraction, _is_eval(f"prompt-{n}", spec.eval_fraction)


def build_corpus(
    teacher, tokenizer, corpus_dir: str | Path, spec: CorpusSpec, *,
    progress: bool = True,
) -> Corpus:
    """Build (or finish, or just load) the corpus described by `spec` in `corpus_dir`.

    Generated rows come first (shards of up to SHARD_ROWS prompts, fewer for small corpora)
    until `generated_fraction` of the label positions is reached, then natural windows. `teacher` may be None when the corpus
    is already complete. Raises SpecRouterError if the folder holds a corpus of another spec.
    """
    from tqdm.auto import tqdm

    corpus_dir = Path(corpus_dir)
    corpus_dir.mkdir(parents=True, exist_ok=True)
    spec_path = corpus_dir / "spec.json"
    if spec_path.exists():
        old = {"prompts": "v1", **json.loads(spec_path.read_text())}
        # the target is compared by vocabulary, not by path: a moved or re-converted target
        # (same model, another folder) keeps its corpus
        if {**old, "target": None} != {**spec.__dict__, "target": None}:
            raise SpecRouterError(
                f"{corpus_dir} holds a corpus built with other settings ({old}); "
                "use another out_dir / corpus_dir, or delete that folder to rebuild it")
    else:
        spec_path.write_text(json.dumps(spec.__dict__, indent=1))
    shard_paths = sorted(corpus_dir.glob("shard-*.pt"))
    shards = [torch.load(p) for p in shard_paths]
    count = lambda sh: int((sh["lengths"] - 1).clamp(min=0).sum())  # noqa: E731
    gen_batch = max(4, min(SHARD_ROWS, spec.corpus_tokens // (8 * spec.seq_len)))
    if not (corpus_dir / "done").exists():
        if teacher is None:
            raise SpecRouterError(f"corpus in {corpus_dir} is incomplete and no teacher was given")
        n_gen = int(spec.corpus_tokens * spec.generated_fraction)
        gen_done = sum(count(s) for s in shards if s["source"][0] < SOURCE_IDS["stdlib"])
        nat_done = sum(count(s) for s in shards if s["source"][0] >= SOURCE_IDS["stdlib"])
        bar = tqdm(total=spec.corpus_tokens, initial=gen_done + nat_done, unit="tok",
                   desc="corpus", disable=not progress, dynamic_ncols=True)
        rng = random.Random(spec.seed)
        stop = _stop_ids(tokenizer)
        # 1. generated rows; a resumed build replays the seeded prompt and window streams past
        #    its finished shards, and every shard samples with its own seed: resuming is exact
        prompts = _prompt_stream(tokenizer, spec, rng)
        n_gen_shards = sum(1 for s in shards if s["source"][0] < SOURCE_IDS["stdlib"])
        i = 0
        while gen_done < n_gen:
            batch = [next(prompts) for _ in range(gen_batch)]
            if i < n_gen_shards:
                i += 1
                continue
            rows = generate_rows(
                teacher, [b[1] for b in batch], [b[2] for b in batch], max_len=spec.seq_len,
                k=spec.teacher_topk, temperature=spec.temperature, stop_ids=stop,
                generator=torch.Generator().manual_seed(spec.seed * 100_003 + i))
            shard = _pack(rows, spec.seq_len, spec.teacher_topk,
                          [SOURCE_IDS[b[0]] for b in batch], [b[3] for b in batch])
            _save_shard(corpus_dir, len(shards), shard)
            shards.append(shard)
            gen_done += count(shard)
            bar.update(count(shard))
            i += 1
        # 2. natural windows, labelled by the teacher
        windows = _natural_windows(tokenizer, spec, random.Random(spec.seed + 1))
        n_nat_shards = sum(1 for s in shards if s["source"][0] >= SOURCE_IDS["stdlib"])
        j = 0
        while gen_done + nat_done < spec.corpus_tokens:
            batch = [w for _, w in zip(range(gen_batch), windows)]
            if not batch:
                break
            if j < n_nat_shards:
                j += 1
                continue
            labelled = label_rows(teacher, [w[1] for w in batch], spec.teacher_topk)
            rows = [(w[1], ids[:-1], logp[:-1]) for w, (ids, logp) in zip(batch, labelled)]
            shard = _pack(rows, spec.seq_len, spec.teacher_topk,
                          [SOURCE_IDS[w[0]] for w in batch], [w[2] for w in batch])
            _save_shard(corpus_dir, len(shards), shard)
            shards.append(shard)
            nat_done += count(shard)
            bar.update(count(shard))
            j += 1
        bar.close()
        (corpus_dir / "done").touch()
    return Corpus(shards)


def load_corpus(corpus_dir: str | Path, like: CorpusSpec | None = None) -> Corpus:
    """A finished corpus folder; with `like`, checked to share its vocabulary, row length and
    teacher k (what rows of two corpora need to be trained on together)."""
    corpus_dir = Path(corpus_dir)
    if not (corpus_dir / "done").exists():
        raise SpecRouterError(f"{corpus_dir} is not a finished corpus (no 'done' marker)")
    spec = json.loads((corpus_dir / "spec.json").read_text())
    if like is not None:
        for key in ("vocab_size", "seq_len", "teacher_topk"):
            if spec.get(key) != getattr(like, key):
                raise SpecRouterError(
                    f"{corpus_dir} has {key}={spec.get(key)}, the main corpus {getattr(like, key)}")
    return Corpus([torch.load(p) for p in sorted(corpus_dir.glob("shard-*.pt"))])


def _save_shard(corpus_dir: Path, index: int, shard: dict) -> None:
    tmp = corpus_dir / f"shard-{index:05d}.pt.tmp"
    torch.save(shard, tmp)
    tmp.rename(corpus_dir / f"shard-{index:05d}.pt")
