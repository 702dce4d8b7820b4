"""How good a draft is: held-out greedy agreement with its target, end to end (the acceptance
proxy), agreement and KL on a corpus's held-out rows, and per-step cost.

The target continues a fixed, mixed set of prompts (code, prose, chat through its template,
extraction) greedily; one forward of the draft over each whole sequence then says, at every
generated position, whether the draft's argmax is the token the target wrote. That fraction is
the per-token acceptance probability a greedy draft-then-verify cycle sees (docs/design.md: greedy
acceptance = P(argmax_draft == argmax_target) along the target's own output).

The prompts are written here by hand (session 28; the earlier set was not held out: the v1
generator wrote its chat prompt whole and paraphrased two more, docs/drafts.md), on topics
that neither prompt generator's lists (corpus.py's v1, prompts_v2.py) nor the bench's prompts
hold. tests/test_distill_heldout.py fails if either generator writes a word run of min(5, its
words) of any of them, if one is a bench prompt, or if a topic stem of HELDOUT_TOPICS begins a
word of a generator's draw or of a string in its module-level lists (a generator taught a held-out
topic in other words: review28 D1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specrouter.distill.corpus import SOURCES, Corpus

# (kind, text, through the chat template?)
HELDOUT_PROMPTS: tuple[tuple[str, str, bool], ...] = (
    ("code", "def rle_encode(s):\n    \"\"\"Run-length encode a string: 'aaab' -> 'a3b1'.\"\"\"\n", False),
    ("code", "import itertools\n\n\ndef tic_tac_toe_winner(board):\n", False),
    ("code", "class Thermostat:\n    def __init__(self, target):\n        self.target = target\n"
             "        self.heating = False\n\n    def update(self, reading):\n", False),
    ("code", "Write a Python function that checks whether a filled-in 9x9 sudoku grid is valid.", True),
    ("prose", "The kettle had barely begun to whistle when someone knocked at the back door, and", False),
    ("prose", "Sea otters hold hands while they sleep so that", False),
    ("prose", "Write a short paragraph about a village football match on a muddy pitch.", True),
    ("chat", "How do I get red wine out of a white cotton shirt?", True),
    ("chat", "Why does my own voice sound so strange on a recording?", True),
    ("chat", "How does a fridge keep its inside cold when the kitchen around it is warm?", True),
    ("extraction", "Name only the tools in this sentence, comma-separated: Before lunch Ana fetched a "
                   "hammer, her uncle borrowed the saw, and the twins lost a screwdriver in the grass.", True),
    ("extraction", "Copy this sentence word for word: The choir rehearses in the old chapel every "
                   "Thursday, except in August.", True),
)

# the topic of each HELDOUT_PROMPTS entry, same order: stems that begin a word (case-insensitive;
# "-" and "_" read as spaces, camelCase split) of no generator draw or list string
HELDOUT_TOPICS: tuple[tuple[str, ...], ...] = (
    ("run length", "rle"), ("tic tac toe", "noughts and crosses"), ("thermostat",), ("sudoku",),
    ("kettle",), ("otter",), ("football", "soccer"),
    ("red wine", "stain"), ("own voice", "recording"), ("fridge", "refrigerat"),
    ("screwdriver", "hammer"), ("choir", "chapel"),
)


@dataclass
class AgreementReport:
    agreement: float  # over all generated positions of all prompts
    by_kind: dict[str, float]
    positions: int  # generated positions scored
    max_new_tokens: int
    per_prompt: list[dict] = field(default_factory=list)


def _prompt_ids(tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def greedy_agreement(draft, target, tokenizer, *, max_new_tokens: int = 96,
                     prompts=HELDOUT_PROMPTS) -> AgreementReport:
    """`draft`, `target`: transformers causal LMs sharing `tokenizer` (float32 recommended).
    The target generates greedily (stopping at its eos); the draft is scored teacher-forced."""
    hits: dict[str, list[int]] = {}
    per_prompt = []
    eos = target.generation_config.eos_token_id
    for kind, text, chat in prompts:
        ids = torch.tensor([_prompt_ids(tokenizer, text, chat)])  # (1, P)
        P = ids.shape[1]
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=max_new_tokens, eos_token_id=eos,
                              pad_token_id=tokenizer.pad_token_id or 0)  # (1, P + N)
        n = out.shape[1] - P
        if n == 0:
            continue
        # position P-1+i predicts generated token i; the target's own argmax is that token
        pred = draft(input_ids=out[:, :-1]).logits[0, P - 1 :].argmax(-1)  # (n,)
        agree = (pred == out[0, P:]).tolist()
        h = hits.setdefault(kind, [0, 0])
        h[0] += sum(agree)
        h[1] += n
        per_prompt.append({"kind": kind, "prompt": text[:60], "generated": n,
                           "agreement": round(sum(agree) / n, 4)})
    total = sum(h[1] for h in hits.values())
    return AgreementReport(
        agreement=sum(h[0] for h in hits.values()) / total if total else float("nan"),
        by_kind={k: h[0] / h[1] for k, h in hits.items()},
        positions=total, max_new_tokens=max_new_tokens, per_prompt=per_prompt,
    )


# ---------------------------------------------------------------------------------------------
# On a distillation corpus (held-out rows) and per-step cost



@torch.no_grad()
def evaluate(student, corpus: Corpus, rows: torch.Tensor, batch: int = 8, chunk: int = 512) -> dict:
    """Held-out agreement (student argmax == teacher argmax) and (k+1)-bin KL on `rows`,
    float32, overall, per source and per kind."""
    names = list(SOURCES)
    agree = torch.zeros(len(names), dtype=torch.float64)
    kl = torch.zeros(len(names), dtype=torch.float64)
    count = torch.zeros(len(names), dtype=torch.float64)
    for s in range(0, len(rows), batch):
        r = rows[s : s + batch]
        T = int(corpus.lengths[r].max())
        mask = corpus.label_mask(r)[:, :T]
        hidden = student.model(input_ids=corpus.tokens[r, :T]).last_hidden_state[mask]  # (N, d)
        ids = corpus.topk_ids[r, :T][mask].long()  # (N, k)
        logp = corpus.topk_logp[r, :T][mask].float()
        src = corpus.source[r][:, None].expand(-1, T)[mask]  # (N,)
        for c in range(0, hidden.shape[0], chunk):
            logq = torch.log_softmax(student.lm_head(hidden[c : c + chunk]).float(), -1)
            i, lp = ids[c : c + chunk], logp[c : c + chunk]
            hit = (logq.argmax(-1) == i[:, 0]).double()
            logq_k = logq.gather(1, i)
            p = lp.exp()
            pt = (1 - p.sum(-1)).clamp(min=0)
            qt = (1 - logq_k.exp().sum(-1)).clamp(min=1e-12)
            k_l = (p * (lp - logq_k)).sum(-1) + pt * (pt.clamp(min=1e-12).log() - qt.log())
            sc = src[c : c + chunk]
            agree.index_add_(0, sc, hit)
            kl.index_add_(0, sc, k_l.double())
            count.index_add_(0, sc, torch.ones_like(hit))
    ratio = lambda a, n: float(a / n) if n > 0 else float("nan")  # noqa: E731
    by_source = {n: ratio(agree[i], count[i]) for i, n in enumerate(names) if count[i] > 0}
    by_kind = {}
    for kind in sorted(set(SOURCES.values())):
        sel = [i for i, n in enumerate(names) if SOURCES[n] == kind]
        if count[sel].sum() > 0:
            by_kind[kind] = ratio(agree[sel].sum(), count[sel].sum())
    gen = [i for i, n in enumerate(names) if n.startswith("gen-")]
    return {
        "agreement": ratio(agree.sum(), count.sum()),
        "agreement_by_kind": by_kind,
        "agreement_by_source": by_source,
        "agreement_generated": ratio(agree[gen].sum(), count[gen].sum()),
        "kl": ratio(kl.sum(), count.sum()),
        "eval_tokens": int(count.sum()),
    }


@torch.no_grad()
def step_ms(model, context: int = 128, steps: int = 16) -> float:
    """Median wall time (ms) of a 1-token decode step after `context` tokens (transformers,
    float32, DynamicCache)."""
    from transformers import DynamicCache

    from specrouter.distill.corpus import _cache_kw

    model = model.float().eval()
    cache = {_cache_kw(model): DynamicCache()}
    ids = torch.randint(0, model.config.vocab_size, (1, context + steps))
    model(input_ids=ids[:, :context], **cache, use_cache=True)
    times = []
    for t in range(context, context + steps):
        t0 = time.perf_counter()
        model(input_ids=ids[:, t : t + 1], **cache, use_cache=True)
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]
