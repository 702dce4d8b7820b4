"""The benchmark's requests: prompts per request type, and the mixed stream where the type shifts.

Request types (`KINDS`), each a different regime for speculation:
- code: raw completion of Python stubs (no chat template); drafts that know code accept well;
- prose: raw continuation of narrative / expository text (no chat template); open-ended, drafts
  accept least;
- chat: a user message in the target's chat template, answered freely;
- extraction: a chat request whose answer copies from the prompt (repeat, rewrite, extract):
  the n-gram / prompt-lookup drafter proposes long correct runs.

The lists are ordered: `--prompts-per-type n` takes the first n of each, so a quick run uses the
most typical prompt of every type. Two prompt sets (`PROMPT_SETS`, `--prompt-set`) give these four
types: "original" (the lists below, what every earlier figure was measured on) and "fresh28"
(bench/fresh28.py: held out from the drafts' training prompts, written in session 28). The other
streams (templated, multiturn, structured) are the same in both.

The templated stream (`templated_stream`, workload "templated") is traffic that repeats itself
ACROSS requests, where a drafter that learns from earlier requests (suffix) gains and one that
looks only at the row's own context (n-gram) cannot: the same extraction task over different
records ("template"), the same tool-call instruction with different arguments ("tool"), and
exact retries of earlier requests ("retry"), interleaved, retries last.

The multi-turn stream (`multiturn_stream`, workload "multiturn") is chat conversations of
`TURNS` turns, interleaved (turn 1 of every conversation, then turn 2, ...): each turn re-sends
the whole conversation, the system's own earlier replies included (as a chat client does), so
the history of a request depends on what that system answered before (`Request.conversation`,
`Request.turn`; the loop builds the prompt per system). Where a prefix cache helps most: turn t
starts with everything turn t-1 computed.

The structured stream (`structured_stream`, workload "structured"; bench/structured.py) is chat
requests constrained to a JSON schema (`Request.json_schema`): field extraction, tool-call
arguments, JSON lists, interleaved. Only the native systems run it (transformers and llama.cpp
rows decode without the grammar); every output is checked against its schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from specrouter.bench import fresh28
from specrouter.bench.structured import PER_KIND, STRUCTURED

KINDS = ("code", "prose", "chat", "extraction")
MIXED_ORDER = ("extraction", "prose", "code", "chat")  # the mixed stream's order of types

CODE = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return it as a dict.\"\"\"\n",
    "class Stack:\n    \"\"\"A simple last-in first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "def is_prime(n: int) -> bool:\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "# Binary search over a sorted list\ndef binary_search(items, target):\n",
]
PROSE = [
    "The old lighthouse stood at the edge of the cliff, and every night its keeper climbed the "
    "stairs to",
    "Photosynthesis is the process by which plants",
    "In the spring of 1848, the small town of",
    "The history of the printing press begins",
    "She opened the door slowly and saw",
    "Rivers shape the land around them in several ways.",
]
CHAT = [
    "What are three good habits for staying healthy? Answer briefly.",
    "Explain why the sky is blue to a ten year old.",
    "Give me some advice for a job interview.",
    "Write a short poem about the sea.",
    "What is the difference between a list and a tuple in Python?",
    "Describe a walk through a forest in autumn.",
]
EXTRACTION = [
    "Repeat the following list exactly, one item per line: apples, bananas, cherries, dates, "
    "elderberries, figs, grapes, honeydew, kiwis, lemons.",
    "Repeat this paragraph word for word: Speculative decoding drafts several tokens with a "
    "small model and lets the large model check them all in one forward pass. When the draft is "
    "right, many tokens are produced for the price of one step of the large model; when it is "
    "wrong, the large model's own token is kept, so the output never changes.",
    "Rewrite this Python code exactly as it is:\n\ndef add(a, b):\n    return a + b\n\n"
    "def sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n",
    "Copy this sentence three times: The quick brown fox jumps over the lazy dog.",
    "Extract the names from this text and list them: Alice met Bob at the station. Later, "
    "Carol and Dave joined Alice and Bob for dinner, and Erin arrived with Frank.",
    "Convert this list to a JSON array of strings: red, green, blue, yellow, purple, orange, "
    "black, white.",
]
TEMPLATE = (
    "Extract the person's name, age, city and job from the record below. Answer with one JSON "
    "object with the keys \"name\", \"age\", \"city\" and \"job\", and nothing else.\n\nRecord: {}"
)
RECORDS = [
    "Maria Lopez is a 34 year old nurse who lives in Madrid.",
    "Tom Becker, 52, works as a carpenter in Hamburg.",
    "Aiko Tanaka (age 27) is a software engineer based in Osaka.",
    "Living in Lyon, 45-year-old teacher Claire Martin loves hiking.",
    "Rahul Mehta is 39. He is a doctor in Mumbai.",
    "The baker Sven Olsen, aged 61, has a shop in Oslo.",
    "Lucia Rossi, a 23 year old student, lives in Rome.",
]
TOOL = (
    "You are an assistant that answers only by calling a tool. The only tool is get_weather. "
    "Reply with exactly one line of JSON of the form {{\"tool\": \"get_weather\", \"arguments\": "
    "{{\"city\": ..., \"unit\": \"celsius\"}}}}.\n\nUser: {}"
)
TOOL_ASKS = [
    "What is the weather like in Paris today?",
    "Is it raining in Berlin right now?",
    "How warm is it in Cairo?",
    "Tell me the temperature in Toronto.",
    "Do I need a coat in Warsaw today?",
    "What's the weather in Lima?",
]
CONVERSATIONS = [  # the user's messages, one conversation each (TURNS turns)
    ["Hi! I am planning a trip to Lisbon next spring. What should I know before I go?",
     "What neighbourhoods are best to stay in for a first visit?",
     "And what should I eat there? I like seafood.",
     "How many days would you recommend, and is a day trip to Sintra worth it?",
     "Thanks. Can you summarize the plan in a short list?"],
    ["I want to learn Python. Where should I start?",
     "What is the difference between a list and a dictionary?",
     "Can you show me a short example of a loop over a dictionary?",
     "How do I read a text file line by line?",
     "Great. What should I learn after these basics?"],
    ["My tomato plants have yellow leaves. What could be wrong?",
     "I water them every day. Is that too much?",
     "What kind of fertilizer should I use?",
     "When is the best time to harvest the tomatoes?",
     "Can you give me a short checklist for next season?"],
]
TURNS = 5  # turns per conversation
PROMPTS = {"code": CODE, "prose": PROSE, "chat": CHAT, "extraction": EXTRACTION}
PROMPT_SETS = {"original": PROMPTS, "fresh28": fresh28.PROMPTS}  # --prompt-set: the four types' prompts
CHAT_KINDS = frozenset({"chat", "extraction"})  # sent through the target's chat template


@dataclass(frozen=True)
class Request:
    """One benchmark request."""

    kind: str  # code | prose | chat | extraction | template | tool | retry | turn
    prompt: str  # raw text, or the user message of a chat request
    chat: bool  # wrap `prompt` in the target's chat template
    conversation: int | None = None  # multi-turn: the conversation (its earlier turns are re-sent)
    turn: int = 0  # multi-turn: 0 for the first turn of its conversation
    json_schema: str | None = None  # structured: the JSON schema (its text) the output follows


@dataclass(frozen=True)
class Workload:
    """A named, ordered list of requests."""

    name: str  # a kind, "mixed", "templated" or "multiturn"
    requests: tuple[Request, ...]


def prompts_of(prompt_set: str) -> dict[str, list[str]]:
    """The four request types' prompt lists of a prompt set ("original" or "fresh28")."""
    if prompt_set not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {prompt_set!r}; use one of {tuple(PROMPT_SETS)}")
    return PROMPT_SETS[prompt_set]


def requests_of(kind: str, n: int, prompt_set: str = "original") -> list[Request]:
    """The first `n` prompts of a request type, from `prompt_set`."""
    if kind not in PROMPTS:
        raise ValueError(f"unknown request type {kind!r}; use one of {KINDS}")
    prompts = prompts_of(prompt_set)[kind]
    if not 1 <= n <= len(prompts):
        raise ValueError(f"prompts per type must be in 1..{len(prompts)}, got {n}")
    return [Request(kind, p, kind in CHAT_KINDS) for p in prompts[:n]]


def templated_stream(n: int) -> list[Request]:
    """`n` + 1 extraction records and `n` tool calls through one template each, alternating, then
    exact retries of the first two requests (chat template; see the module docstring)."""
    if not 1 <= n <= len(TOOL_ASKS):
        raise ValueError(f"prompts per type must be in 1..{len(TOOL_ASKS)}, got {n}")
    records = [Request("template", TEMPLATE.format(r), True) for r in RECORDS[: n + 1]]
    tools = [Request("tool", TOOL.format(a), True) for a in TOOL_ASKS[:n]]
    out = [r for pair in zip(records, tools) for r in pair] + records[n:]
    return out + [Request("retry", r.prompt, True) for r in out[:2]]


def multiturn_stream(n: int) -> list[Request]:
    """`n` conversations of `TURNS` turns, interleaved by turn (see the module docstring)."""
    if not 1 <= n <= len(CONVERSATIONS):
        raise ValueError(f"conversations (prompts per type) must be in 1..{len(CONVERSATIONS)}, got {n}")
    return [Request("turn", CONVERSATIONS[c][t], True, conversation=c, turn=t)
            for t in range(TURNS) for c in range(n)]


def structured_stream(n: int) -> list[Request]:
    """The first `n` requests of each structured kind (extract, tool, list), interleaved."""
    if not 1 <= n <= PER_KIND:
        raise ValueError(f"prompts per type must be in 1..{PER_KIND} for the structured workload, got {n}")
    return [Request(kind, prompt, True, json_schema=json.dumps(schema))
            for kind, schema, prompt in STRUCTURED[: 3 * n]]


def conversation_messages(req: Request, history: list[dict]) -> list[dict]:
    """The chat messages a multi-turn request sends: the conversation so far, then its message."""
    return history + [{"role": "user", "content": req.prompt}]


def mixed_stream(n: int, block: int = 2, kinds: tuple[str, ...] = MIXED_ORDER,
                 prompt_set: str = "original") -> list[Request]:
    """Every type's first `n` prompts (of `prompt_set`), the type shifting every `block` requests:
    with n=3, block=2: e0 e1 p0 p1 c0 c1 h0 h1 e2 p2 c2 h2 (extraction, prose, code, chat)."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    queues = {k: requests_of(k, n, prompt_set) for k in kinds}
    out: list[Request] = []
    while any(queues.values()):
        for k in kinds:
            out.extend(queues[k][:block])
            queues[k] = queues[k][block:]
    return out


def build_workloads(names: tuple[str, ...], n: int, block: int = 2, repeat: int = 1,
                    kinds: tuple[str, ...] = MIXED_ORDER, prompt_set: str = "original") -> list[Workload]:
    """Workloads by name: a request type (its first `n` prompts of `prompt_set`) or "mixed"
    (`mixed_stream` of `kinds`); every request list is repeated `repeat` times (passes over the
    same prompts). `prompt_set` picks the four types' prompts; the other streams ignore it."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    prompts_of(prompt_set)  # a bad name fails before any stream is built
    out = []
    for name in names:
        if name == "mixed":
            reqs = mixed_stream(n, block, kinds, prompt_set)
        elif name == "templated":
            reqs = templated_stream(n)
        elif name == "multiturn":
            reqs = multiturn_stream(min(n, len(CONVERSATIONS)))
        elif name == "structured":
            reqs = structured_stream(min(n, PER_KIND))
        else:
            reqs = requests_of(name, n, prompt_set)
        out.append(Workload(name, tuple(reqs) * repeat))
    return out


@dataclass(frozen=True)
class Scenario:
    """One workload at one temperature, possibly with a scripted slowdown."""

    name: str  # e.g. "code greedy", "mixed t=0.7", "mixed greedy + slowdown"
    workload: Workload
    temperature: float
    slowdown_start: int | None  # first request slowed (None: no slowdown)
    hf: bool  # run the transformers baselines
