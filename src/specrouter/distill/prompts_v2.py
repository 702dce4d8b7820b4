"""The corpus's second prompt set ("v2"): what chat clients and completion callers send.

The first set (corpus.py, "v1") asks one templated question per chat, from 12 asks; a draft
trained on it agrees with the target far less on real chats than on its own held-out rows.
This set widens every generated source:

- chat: with or without a system prompt (none: the template's own default), zero to two earlier
  turns (a user ask and a short canned assistant reply, or a follow-up that refers back), and
  many kinds of ask (`CHAT_KINDS`): explain, advise, rewrite or edit a given text, summarize a
  given passage, extract fields from it, compare, plan, brainstorm, recipes, travel, emails,
  stories, poems, jokes, code questions, math word problems, opinions, role play, definitions,
  in several registers (terse, casual, polite, detailed with context);
- prose, code and Q&A: the raw-completion openings, in prompts_v2_raw.py.

This file holds the word lists both draw from, the composed passages, and the chat asks.

Every generator is a pure function of its `random.Random`: a corpus's prompts are a function of
its seed. Passages to summarize, edit or extract from are composed here from parts, so no
prompt is copied from anywhere.
"""

from __future__ import annotations

import random
from typing import Callable

SUBJECTS = (
    "tides", "compound interest", "the immune system", "plate tectonics", "sourdough starters",
    "the Silk Road", "neural networks", "supply and demand", "migrating birds", "solar panels",
    "the Cold War", "coral reefs", "blood pressure", "cryptography", "the Byzantine Empire",
    "fermentation", "wind turbines", "the placebo effect", "jet engines", "the Amazon river",
    "credit scores", "memory and forgetting", "the periodic table", "urban gardening",
    "the Apollo program", "procrastination", "quantum computing", "antibiotics", "the Vikings",
    "houseplants", "inflation", "sleep cycles", "the telegraph", "electric guitars",
    "recycling plastics", "the Mughal Empire", "telescopes", "minimalism", "marathon training",
    "the water table", "GPS satellites", "the Great Depression", "honey", "volcanic islands",
    "remote work", "caffeine", "the Renaissance painters", "open source software", "lightning",
    "impressionism", "tax brackets", "octopuses", "3D printing", "the Ottoman Empire",
    "meditation", "rust on metal", "the stock exchange", "tea ceremonies", "hurricanes",
    "public transport", "DNA sequencing", "vinyl records", "the Maya civilization", "mushrooms",
    "batteries", "the scientific method", "jazz improvisation", "desert ecosystems",
    "password managers", "the Roman roads", "tidal energy", "budget airlines", "origami",
    "earthquake safety", "the human eye", "video game design", "cheese making", "glaciers",
    "the French Revolution", "urban beekeeping", "microplastics", "chess openings",
    "the Hubble telescope", "freelancing", "wildfires", "the metric system", "bees",
)
PEOPLE = (
    "Maria", "Tom", "Aisha", "Kenji", "Lena", "Carlos", "Priya", "Olu", "Sofia", "Daniel",
    "Mei", "Jonas", "Fatima", "Luca", "Hannah", "Ravi", "Chloe", "Ahmed", "Ingrid", "Sam",
)
PLACES = (
    "Tallinn", "Kyoto", "Marrakesh", "Vancouver", "Prague", "Cape Town", "Hanoi", "Edinburgh",
    "Buenos Aires", "Reykjavik", "Istanbul", "Melbourne", "Oaxaca", "Copenhagen", "Nairobi",
    "a small coastal town", "the mountains", "a national park", "the countryside",
)
DISHES = (
    "lentil soup", "banana bread", "a vegetable stir-fry", "pancakes", "chicken curry",
    "a Greek salad", "tomato pasta sauce", "chocolate chip cookies", "fried rice", "guacamole",
    "a mushroom risotto", "overnight oats", "a simple omelette", "roasted vegetables", "hummus",
)
CHARACTERS = (
    "a retired astronaut", "a shy librarian", "a talking fox", "a street musician", "twin detectives",
    "a baker who can't taste", "the last dragon", "a ship's cat", "a time-traveling student",
    "a robot gardener", "an old fisherman", "a nervous wizard", "a windmill on a hill",
    "two rival chefs", "a girl who collects maps", "a ghost in a museum",
)
CODE_TASKS = (
    "reverse the words in a sentence", "check whether a year is a leap year",
    "find the longest common prefix of a list of strings", "rotate a list by k positions",
    "count the lines in a file", "compute a running average", "chunk a list into pieces of size n",
    "convert a Roman numeral to an integer", "find duplicate files by size", "parse a date string",
    "validate a phone number", "compute the Levenshtein distance", "shuffle a deck of cards",
    "implement a queue with two stacks", "find the k most common words", "merge overlapping intervals",
    "compute the dot product of two vectors", "flatten a dictionary of dictionaries",
    "debounce a function call", "retry a network request with backoff", "rotate a log file",
    "sum the digits of a number", "find all primes below n", "check balanced parentheses",
    "convert snake_case to camelCase", "paginate a list of items", "cache function results",
    "compute the median of a stream", "build a word frequency histogram", "deep copy a nested list",
    "implement a binary search tree", "format a number with thousands separators",
    "compute compound interest", "split a full name into first and last", "detect a cycle in a graph",
)
LANGUAGES = ("Python", "JavaScript", "TypeScript", "Java", "C", "C++", "Rust", "Go", "Bash", "SQL")
ACTIVITIES = (
    "waking up earlier", "learning to play the guitar", "running my first 10k", "saving for a house",
    "keeping a journal", "reading more books", "cooking at home more", "learning to knit",
    "getting better at chess", "staying productive while working from home", "starting a podcast",
    "training a puppy", "drinking more water", "getting into photography", "preparing for a long hike",
)
OPINION_TOPICS = (
    "homework", "four-day work weeks", "electric scooters in cities", "social media for teenagers",
    "standing desks", "learning Latin in school", "self-driving cars", "tipping", "open-plan offices",
    "e-books versus paper books", "cash versus cards", "daylight saving time",
)

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant. Keep your answers short and to the point.",
    "You are a friendly tutor who explains things to high-school students step by step.",
    "You are an experienced software engineer. Answer with working code and brief explanations.",
    "You are a concise assistant. Answer in no more than three sentences.",
    "You are a warm and encouraging life coach.",
    "You are a travel planner with a love for local food and hidden gems.",
    "You are a careful editor. Fix grammar and clarity without changing the meaning.",
    "Format every answer as JSON.",
    "You are a patient math teacher. Show your reasoning, then give the final answer.",
    "You are a customer support agent for an online bookshop. Be polite and helpful.",
    "You are a storyteller who writes vivid, short fiction for children.",
    "You are a knowledgeable historian. Be accurate and mention dates where useful.",
    "You are an AI assistant. Use bullet points when listing things.",
    "You are a chef. Give practical recipes with ingredient lists and numbered steps.",
    "You are a helpful assistant that writes clear, professional emails.",
    "Always answer in a cheerful tone.",
    "You are a fitness coach. Be practical and safety-conscious.",
)

# ---------------------------------------------------------------------------------------------
# Composed passages (what a user pastes to be summarized, edited or mined)


def passage(rng: random.Random) -> str:
    who, other = rng.sample(PEOPLE, 2)
    place, subject = rng.choice(PLACES), rng.choice(SUBJECTS)
    day = rng.choice(("Monday", "Tuesday", "Wednesday", "Thursday", "Friday"))
    n, price = rng.randint(3, 40), rng.randint(5, 400)
    month = rng.choice(("March", "April", "June", "September", "October", "November"))
    forms = [
        f"{who} met with {other} on {day} to discuss the budget for the {subject} project. They agreed "
        f"to hire {n} more people by {month}, but {other} is worried that the costs, about ${price} per "
        f"person per week, will be higher than planned. The next meeting is on {month} {rng.randint(1, 28)}.",
        f"I bought this blender {n} weeks ago for ${price}. It is loud, but it crushes ice easily and "
        "the jar is easy to clean. The lid started to crack after a month, and customer service took "
        f"{rng.randint(2, 9)} days to answer my email. Overall it does the job, but I expected more.",
        f"The city council of {place} voted on {day} to expand its bike lanes by {n} kilometers. "
        "Supporters say the plan will cut traffic and pollution, while some shop owners fear losing "
        f"parking spaces. Work is expected to begin in {month} and cost around {price} thousand dollars.",
        f"Hi team, a quick update: the launch moved from {day} to next week because testing found "
        f"{n} bugs in the checkout page. {who} is fixing the payment ones first. Please send me your "
        f"notes by {month} {rng.randint(1, 28)}. Thanks, {other}",
        f"Researchers studying {subject} followed {n * 10} volunteers for {rng.randint(2, 12)} months. "
        "They found that small daily habits mattered more than occasional big efforts, although the "
        "effect was weaker in older participants. The authors say larger studies are needed.",
        f"Our trip to {place} started badly: the train was {n} minutes late and it rained all of the "
        f"first day. Then the sun came out, we found a tiny restaurant near the harbour, and {who} "
        f"says it was the best meal of the year. We paid {price} euros for the whole weekend.",
        f"Order #{rng.randint(10000, 99999)}: {n} x notebook (A5, dotted), 2 x gel pen (black). "
        f"Total: ${price}.{rng.randint(10, 99)}. Ship to {who} {rng.choice(('Smith', 'Okafor', 'Tanaka', 'Silva'))}, "
        f"{rng.randint(1, 200)} {rng.choice(('Oak', 'Mill', 'River', 'Church'))} Street, {place}. "
        f"Expected delivery: {month} {rng.randint(1, 28)}.",
    ]
    return rng.choice(forms)


def _messy_text(rng: random.Random) -> str:
    return rng.choice((
        "me and him goes to the store yesterday and we buyed alot of stuff for the party, it were fun",
        "Their going to announce the results tomorow, so everyone need to be ready on time.",
        "i think that the meeting should of been shorter because nobody new what the goal was",
        "The report, which was wrote by our team last week, have several mistake in it's tables.",
        "Pls send the file asap, we needs it for the client call wich is at 3",
        "Despite of the rain we decided to went hiking and it was a realy good decision at the end.",
        f"Our product is very very good and it help you to {rng.choice(ACTIVITIES)} more easy than before.",
    ))


# ---------------------------------------------------------------------------------------------
# Chat asks by kind: each returns the user's message


def _explain(rng):
    s = rng.choice(SUBJECTS)
    return rng.choice((
        f"Explain how {s} works.", f"Can you explain {s} like I'm ten years old?",
        f"what's the deal with {s}", f"I never really understood {s}. Could you walk me through it?",
        f"Give me a short explanation of {s} and why it matters.", f"How would you describe {s} to a beginner?",
        f"Why do people care about {s}?", f"In two paragraphs, what should everyone know about {s}?",
    ))


def _advise(rng):
    a = rng.choice(ACTIVITIES)
    return rng.choice((
        f"Any advice on {a}?", f"I keep failing at {a}. What am I doing wrong?",
        f"What are some realistic tips for {a} when you have a busy job?",
        f"My friend wants to start {a}. What should I tell her?",
        f"I'm {rng.randint(19, 68)} and thinking about {a}. Is it too late, and how do I begin?",
        f"Give me a simple weekly routine for {a}.",
    ))


def _rewrite(rng):
    text = _messy_text(rng) if rng.random() < 0.6 else passage(rng)
    how = rng.choice((
        "Fix the grammar in this sentence", "Rewrite this to sound more professional",
        "Make this more concise", "Rewrite this in a friendly, casual tone", "Proofread this",
        "Can you make this clearer?", "Turn this into a polite message to my manager",
        "Rewrite this for a ten-year-old",
    ))
    return f"{how}:\n\n{text}" if rng.random() < 0.7 else f'{how}: "{text}"'


def _summarize(rng):
    text = passage(rng)
    how = rng.choice((
        "Summarize this in one sentence:", "TL;DR this please", "Give me the key points of the text below.",
        "Summarize the following for a busy executive.", "What is the main idea here?",
        "Write a two-line summary:",
    ))
    return f"{how}\n\n{text}" if rng.random() < 0.7 else f"{text}\n\n{how}"


def _extract(rng):
    text = passage(rng)
    how = rng.choice((
        "List every person, place and date mentioned in this text.",
        "Extract the numbers from this text and say what each one means.",
        "Return a JSON object with the names, dates and amounts in this text.",
        "Pull out the action items from this message as a bullet list.",
        "Who is involved and what did they decide?",
        "Make a table with two columns, item and value, from this text.",
        "Is the tone of this text positive, negative or mixed? Answer with one word, then explain.",
    ))
    return f"{how}\n\n{text}" if rng.random() < 0.6 else f"Text: {text}\n\nTask: {how}"


def _compare(rng):
    a, b = rng.sample(SUBJECTS, 2)
    l1, l2 = rng.sample(LANGUAGES, 2)
    return rng.choice((
        f"Compare {a} and {b}.", f"What's the difference between {l1} and {l2} for a beginner?",
        f"Which is better for a small project, {l1} or {l2}? Why?",
        f"{rng.choice(OPINION_TOPICS).capitalize()}: pros and cons?",
        f"Renting or buying a home in {rng.choice(PLACES)}: what should I consider?",
        f"Give me a side-by-side comparison of trains and planes for a {rng.randint(300, 900)} km trip.",
    ))


def _plan(rng):
    return rng.choice((
        f"Plan a {rng.randint(2, 7)}-day trip to {rng.choice(PLACES)} on a budget.",
        f"Help me plan a birthday party for {rng.randint(5, 30)} people.",
        f"Make a study plan for learning {rng.choice(SUBJECTS)} in {rng.randint(2, 8)} weeks.",
        "Create a weekly meal plan for someone who wants to eat less meat.",
        f"I have {rng.randint(2, 6)} hours on Saturday. Plan a productive but relaxing day.",
        "Outline a project plan for launching a small online shop.",
        f"Give me a {rng.randint(4, 12)}-week plan for {rng.choice(ACTIVITIES)}.",
    ))


def _brainstorm(rng):
    n = rng.randint(3, 12)
    return rng.choice((
        f"Give me {n} ideas for a blog about {rng.choice(SUBJECTS)}.",
        f"Brainstorm {n} names for a coffee shop in {rng.choice(PLACES)}.",
        f"What are {n} fun things to do on a rainy weekend?",
        f"List {n} gift ideas for someone who loves {rng.choice(SUBJECTS)}.",
        f"I need {n} creative team-building activities for a remote team.",
        f"Suggest {n} side projects to practice {rng.choice(LANGUAGES)}.",
    ))


def _recipe(rng):
    d = rng.choice(DISHES)
    return rng.choice((
        f"How do I make {d}?", f"Give me a quick recipe for {d}.", f"recipe for {d} pls",
        f"I have {rng.choice(('eggs', 'rice', 'spinach', 'chickpeas', 'potatoes'))}, onions and garlic. What can I cook tonight?",
        f"What's a vegan version of {d}?", f"How long should I cook {d} and at what temperature?",
    ))


def _travel(rng):
    p = rng.choice(PLACES)
    return rng.choice((
        f"What should I see in {p}?", f"Is {rng.choice(('March', 'July', 'October', 'December'))} a good time to visit {p}?",
        f"What should I pack for a week in {p}?", f"Tips for traveling alone in {p} for the first time?",
        f"How do I get around {p} without a car?", f"Which local dishes should I try in {p}?",
    ))


def _email(rng):
    who = rng.choice(PEOPLE)
    return rng.choice((
        "Write an email to my landlord asking to fix the heating.",
        f"Draft a short email to {who} declining a meeting invitation politely.",
        f"Write a follow-up email after a client meeting about the {rng.choice(('website', 'catering', 'office move', 'training'))} project.",
        f"Help me write an email asking my boss for a day off on {rng.choice(('Friday', 'Monday'))}.",
        f"Write a thank-you note to {who} for helping me move.",
        f"Compose an email to customers announcing a {rng.randint(10, 50)}% discount this weekend.",
        "Write a complaint email about a delayed package.",
    ))


def _story(rng):
    c = rng.choice(CHARACTERS)
    return rng.choice((
        f"Write a short story about {c}.", f"Tell me a bedtime story about {c}.",
        f"Write a {rng.randint(50, 300)}-word story that begins with {c} finding a key.",
        f"Write a poem about {rng.choice(SUBJECTS)}.", f"Write a haiku about {rng.choice(SUBJECTS)}.",
        f"Write a limerick about {c}.", f"Continue this story: {c.capitalize()} opened the door and",
    ))


def _joke(rng):
    s = rng.choice(SUBJECTS)
    return rng.choice((
        f"Tell me a joke about {s}.", "Tell me a joke.", f"Make a pun about {s}.",
        "Write a funny one-liner for a birthday card.", "Got any good jokes about programmers?",
    ))


def _code_question(rng):
    t, lang = rng.choice(CODE_TASKS), rng.choice(LANGUAGES)
    return rng.choice((
        f"Write a {lang} function to {t}.", f"How do I {t} in {lang}?",
        f"What's the fastest way to {t} in Python?", f"Can you show me how to {t}? Use {lang}.",
        "Why does my Python code give 'IndexError: list index out of range' when I loop over a list?",
        "Explain what this does:\n\nsquares = [x * x for x in range(10) if x % 2 == 0]",
        "How do Python decorators work? Show me a tiny example that logs each call.",
        f"Write a SQL query that returns the {rng.randint(3, 10)} customers with the most orders.",
        "How do I undo my last git commit?", f"Explain recursion with a {lang} example.",
        "Review this function and suggest improvements:\n\ndef avg(xs):\n    total = 0\n    for x in xs:\n        total = total + x\n    return total / len(xs)",
    ))


def word_problem(rng):
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 12)
    who = rng.choice(PEOPLE)
    return rng.choice((
        f"{who} has {a} apples and gives {b if b < a else a // 2} to a friend. How many are left?",
        f"A train travels {a * 10} km in {c} hours. What is its average speed?",
        f"If a shirt costs ${a} and is on sale for {rng.choice((10, 20, 25, 30, 50))}% off, what is the new price?",
        f"What is {a} times {b}?", f"Solve for x: {c}x + {b} = {c * a + b}",
        f"{who} saves ${b} a week. How many weeks until she has ${b * a}?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"What is {rng.choice((15, 20, 12, 8))}% of {a * 10}?",
    ))


def _opinion(rng):
    o = rng.choice(OPINION_TOPICS)
    return rng.choice((
        f"What do you think about {o}?", f"Is {o} a good idea?", f"Convince me that {o} are overrated.",
        f"Give me arguments for and against {o}.", f"Be honest: are {o} worth it?",
    ))


def _roleplay(rng):
    return rng.choice((
        f"Pretend you are {rng.choice(CHARACTERS)} and introduce yourself.",
        "Let's practice a salary negotiation. You are my manager. Start the conversation.",
        f"Act as a tour guide in {rng.choice(PLACES)} and welcome our group.",
        "You are a pirate captain. Tell your crew about today's plan.",
        "Play a shopkeeper in a fantasy village. I walk in and ask what you sell.",
        "Pretend to be a customer who is unhappy about a late order, and I'll be support.",
    ))


def _define(rng):
    w = rng.choice(("serendipity", "opportunity cost", "entropy", "a metaphor", "an API", "biodiversity",
                    "a mortgage", "irony", "latency", "a haiku", "an isotope", "a hypothesis"))
    return rng.choice((f"Define {w}.", f"What does {w} mean?", f"What is {w}? Give an example.",
                       f"Use {w} in a sentence."))


CHAT_KINDS: dict[str, Callable[[random.Random], str]] = {
    "explain": _explain, "advise": _advise, "rewrite": _rewrite, "summarize": _summarize,
    "extract": _extract, "compare": _compare, "plan": _plan, "brainstorm": _brainstorm,
    "recipe": _recipe, "travel": _travel, "email": _email, "story": _story, "joke": _joke,
    "code": _code_question, "math": word_problem, "opinion": _opinion, "roleplay": _roleplay,
    "define": _define,
}

FOLLOW_UPS = (
    "Can you make that shorter?", "Thanks! Can you give me an example?", "Explain that more simply.",
    "What about for beginners?", "Great, now put it in a bullet list.", "Why is that?",
    "Can you add a bit more detail?", "ok and what should I do first?", "Could you translate that into plain English?",
    "That's helpful. Any common mistakes to avoid?", "Now write it as a short paragraph.",
)


def _canned_reply(rng: random.Random) -> str:
    """A short assistant turn for an earlier exchange (the target writes only the last one)."""
    return rng.choice((
        "Sure! Here is a short answer: it depends on your goals, but starting small and staying "
        "consistent usually works best.",
        "Of course. In short, there are three main points: the basics, the common pitfalls, and how "
        "to practise. Let me know which one you want to explore.",
        "Here you go:\n\n1. Start with the simplest version.\n2. Check the result.\n3. Improve step by step.",
        "Good question. The short version is that it comes down to cost, time and what you enjoy.",
        "I'd be happy to help with that. Could you tell me a little more about what you need?",
        "Done! I kept it brief and friendly. Let me know if you want a different tone.",
    ))


def _register(rng: random.Random, ask: str) -> str:
    """The same ask in another register: as written, casual, polite, or with personal context."""
    r = rng.random()
    if r < 0.55:
        return ask
    if r < 0.7:
        return ask[0].lower() + ask[1:].rstrip(".?") + rng.choice(("", "?", " thx", " pls", "!!"))
    if r < 0.85:
        return rng.choice(("Hi! ", "Hello, ", "Hey there. ", "Good morning! ")) + ask + rng.choice(
            ("", " Thank you!", " Thanks in advance.", " I appreciate it."))
    context = rng.choice((
        f"I'm a {rng.choice(('student', 'nurse', 'teacher', 'retired engineer', 'new manager', 'parent of two'))} "
        "and I don't have much time.",
        "I've tried searching online but the answers were confusing.", "This is for a school project.",
        "My English is not perfect, sorry.", "I need this for work tomorrow.",
    ))
    return f"{context} {ask}"


def chat_messages(rng: random.Random) -> tuple[str, list[dict]]:
    """(kind, messages): a chat ending with a user turn, for the target's chat template."""
    kind = rng.choice(list(CHAT_KINDS))
    messages: list[dict] = []
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    r = rng.random()
    if r < 0.25:  # earlier exchanges on other asks, then the new ask
        for _ in range(rng.randint(1, 2)):
            ask = CHAT_KINDS[rng.choice(list(CHAT_KINDS))](rng)
            messages += [{"role": "user", "content": ask},
                         {"role": "assistant", "content": _canned_reply(rng)}]
        messages.append({"role": "user", "content": _register(rng, CHAT_KINDS[kind](rng))})
    elif r < 0.4:  # a follow-up on the previous exchange
        ask = CHAT_KINDS[kind](rng)
        messages += [{"role": "user", "content": ask},
                     {"role": "assistant", "content": _canned_reply(rng)},
                     {"role": "user", "content": rng.choice(FOLLOW_UPS)}]
    else:
        messages.append({"role": "user", "content": _register(rng, CHAT_KINDS[kind](rng))})
    return kind, messages
