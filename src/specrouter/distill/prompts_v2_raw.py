"""The second prompt set's ("v2") raw-completion openings: what completion callers send.

- prose: openings of many genres (news, blog, review, letter, diary, how-to, encyclopedia,
  speech, story, dialogue, product copy) and /usr/share/doc paragraphs;
- code: more tasks and languages, docstring-, comment-, test- and signature-led openings, and
  standard-library snippets;
- Q&A: several answer formats, reading questions over a given passage, word problems.

The word lists, passages and word problems are prompts_v2.py's (the chat asks); every generator
is a pure function of its `random.Random`.
"""

from __future__ import annotations

import random

from specrouter.distill.prompts_v2 import (
    ACTIVITIES,
    CHARACTERS,
    CODE_TASKS,
    DISHES,
    PEOPLE,
    PLACES,
    SUBJECTS,
    passage,
    word_problem,
)


def prose_prompt(rng: random.Random, snippets: list[str]) -> str:
    s, c, p, who = rng.choice(SUBJECTS), rng.choice(CHARACTERS), rng.choice(PLACES), rng.choice(PEOPLE)
    if snippets and rng.random() < 0.2:
        return rng.choice(snippets)
    forms = [
        lambda: f"{p.capitalize()}, {rng.choice(('Monday', 'Friday', 'Sunday'))} - Officials announced today that",
        lambda: f"# What I learned from a year of {rng.choice(ACTIVITIES)}\n\n",
        lambda: f"Review: {rng.choice(DISHES).capitalize()} at a new cafe in {p}\n\n",
        lambda: f"Dear {who},\n\nI hope this letter finds you well. I am writing to",
        lambda: "Dear diary,\n\nToday was",
        lambda: f"How to get started with {s}\n\nStep 1:",
        lambda: f"{s[0].upper()}{s[1:]}\n\nFrom Wikipedia, the free encyclopedia\n\n",
        lambda: "Good evening, everyone. Thank you all for coming tonight. ",
        lambda: f"{c[0].upper()}{c[1:]} had never",
        lambda: f'"Are you sure about this?" {who} asked.\n\n"',
        lambda: f"Introducing the new {rng.choice(('SmartMug', 'TrailLite backpack', 'EchoDesk lamp', 'Nimbus umbrella'))}: ",
        lambda: f"The main reason {s} matters today is",
        lambda: f"When I first moved to {p}, I",
        lambda: f"Chapter {rng.randint(1, 12)}\n\nThe morning {who} left {p},",
        lambda: f"Abstract. We study {s} and",
        lambda: f"Frequently asked questions about {s}\n\n1.",
    ]
    return rng.choice(forms)()


def code_prompt(rng: random.Random, snippets: list[str]) -> str:
    t = rng.choice(CODE_TASKS)
    name = "_".join(w for w in t.lower().replace("-", " ").split() if w.isalnum())[:40]
    camel = name.split("_")[0] + "".join(w.capitalize() for w in name.split("_")[1:])
    if snippets and rng.random() < 0.3:
        return rng.choice(snippets)
    forms = [
        lambda: f"def {name}(",
        lambda: f'def {name}(items):\n    """{t.capitalize()}.\n\n    Args:\n',
        lambda: f"# {t.capitalize()}\nimport {rng.choice(('os', 're', 'json', 'math', 'itertools', 'collections'))}\n\n",
        lambda: f"from typing import List, Optional\n\n\ndef {name}(",
        lambda: f"import pytest\n\n\ndef test_{name}():\n",
        lambda: f"class {camel[0].upper() + camel[1:]}:\n    \"\"\"",
        lambda: f"// {t.capitalize()}\nfunction {camel}(",
        lambda: f"// {t}\nconst {camel} = (",
        lambda: f"/* {t} */\n#include <stdio.h>\n#include <stdlib.h>\n\n",
        lambda: f"// {t}\nfn {name}(",
        lambda: f"// {t}\nfunc {camel}(",
        lambda: f"#!/usr/bin/env bash\n# {t}\n",
        lambda: f"-- {t}\nSELECT ",
        lambda: f"public class {camel[0].upper() + camel[1:]} {{\n    // {t}\n",
        lambda: f"```{rng.choice(('python', 'javascript', 'rust', 'go'))}\n// {t}\n",
        lambda: f"if __name__ == \"__main__\":\n    # {t}\n",
    ]
    return rng.choice(forms)()


def qa_prompt(rng: random.Random) -> str:
    s = rng.choice(SUBJECTS)
    r = rng.random()
    if r < 0.2:
        return f"{passage(rng)}\n\nQuestion: {rng.choice(('Who is mentioned?', 'What happened?', 'What are the numbers about?', 'When is the next step?'))}\nAnswer:"
    if r < 0.35:
        return f"Question: {word_problem(rng)}\nAnswer:"
    return rng.choice((
        f"Q: What is {s}?\nA:", f"Question: How does {s} affect everyday life?\nAnswer:",
        f"Q: What are common myths about {s}?\nA:", f"FAQ\n\nWhat is the best way to learn about {s}?\n\n",
        f"Quiz question: name one fact about {s}.\nAnswer:", f"Q: Who first studied {s}?\nA:",
        f"Question: Is {s} good or bad? Explain briefly.\nAnswer:",
        f"Q: Can you summarize {s} in one sentence?\nA:",
    ))
