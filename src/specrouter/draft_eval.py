"""Held-out greedy agreement of a draft with its target, end to end: the acceptance proxy.

The target continues a fixed, mixed set of prompts (code, prose, chat through its template,
extraction) greedily; one forward of the draft over each whole sequence then says, at every
generated position, whether the draft's argmax is the token the target wrote. That fraction is
the per-token acceptance probability a greedy draft-then-verify cycle sees (DESIGN.md: greedy
acceptance = P(argmax_draft == argmax_target) along the target's own output).

The prompts are written here by hand and none comes from the distillation corpus (whose
prompts are generated from templates, see corpus.py), so the figure is held out by
construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# (kind, text, through the chat template?)
HELDOUT_PROMPTS: tuple[tuple[str, str, bool], ...] = (
    ("code", "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n", False),
    ("code", "import json\n\n\ndef load_config(path):\n", False),
    ("code", "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n", False),
    ("code", "Write a Python function that counts the vowels in a string.", True),
    ("prose", "The old bridge over the river had stood for two hundred years, and", False),
    ("prose", "Photosynthesis is the process by which plants", False),
    ("prose", "Write a short paragraph about a city at night.", True),
    ("chat", "What is the capital of Japan, and what is it known for?", True),
    ("chat", "Give me three tips for learning a new language.", True),
    ("chat", "Explain what a database index is in simple terms.", True),
    ("extraction", "List the colours in this sentence, one per line: The red car passed a blue "
                   "house with a green door and a yellow fence.", True),
    ("extraction", "Repeat this sentence exactly: Every morning the baker opens the shop at six.", True),
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
