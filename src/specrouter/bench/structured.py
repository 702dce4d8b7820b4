"""The `structured` workload's requests (issue 30): chat requests whose output is constrained to
a JSON schema, in three regimes for speculation under a grammar:
- extract: a record's fields into a schema (the values are copied from the prompt: the suffix /
  n-gram drafters propose them; the keys and braces are forced by the grammar);
- tool: the arguments of a function call for a request (mostly forced: the name, the keys, an
  enum; the values come from the request);
- list: a JSON list of objects (the keys repeat per item).
`schema_valid` checks an output against these schemas without a dependency (types, required,
enum, const, no extra keys, maxItems): the bench counts valid outputs per system.
"""

from __future__ import annotations

import json

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "born": {"type": "integer"}, "city": {"type": "string"},
    "occupation": {"type": "string"}}, "required": ["name", "born", "city", "occupation"],
    "additionalProperties": False}
WEATHER_CALL = {"type": "object", "properties": {
    "name": {"const": "get_weather"}, "arguments": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}}, "required": ["city", "unit", "days"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}
SHOPPING = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"item": {"type": "string"}, "quantity": {"type": "integer"}},
    "required": ["item", "quantity"], "additionalProperties": False}, "maxItems": 5}},
    "required": ["items"], "additionalProperties": False}

# (kind, schema, user message); the first of each kind come first in `structured_requests`
STRUCTURED = [
    ("extract", PERSON, "Extract the person's name, birth year, city and occupation as JSON from this "
     "record: Ada Lovelace, born 1815 in London, was a mathematician who wrote the first program."),
    ("tool", WEATHER_CALL, "Call the get_weather function for this request: What will the weather be "
     "in Paris for the next 3 days, in celsius?"),
    ("list", SHOPPING, "Write a shopping list as JSON for a pancake breakfast for four people: flour, "
     "eggs, milk, butter and maple syrup, with quantities."),
    ("extract", PERSON, "Extract the person's name, birth year, city and occupation as JSON from this "
     "record: Alan Turing, born 1912 in London, was a computer scientist and codebreaker."),
    ("tool", WEATHER_CALL, "Call the get_weather function for this request: I need a 5 day forecast "
     "for Chicago in fahrenheit."),
    ("list", SHOPPING, "Turn this into a JSON shopping list with quantities: 2 apples, 3 bananas, "
     "1 bread, 6 eggs."),
    ("extract", PERSON, "Extract the person's name, birth year, city and occupation as JSON from this "
     "record: Marie Curie, born 1867 in Warsaw, was a physicist and chemist."),
    ("tool", WEATHER_CALL, "Call the get_weather function for this request: Will it be cold in Oslo "
     "over the next 2 days? Use celsius."),
    ("list", SHOPPING, "Make a JSON shopping list with quantities for a salad: 1 lettuce, 2 tomatoes, "
     "1 cucumber, 1 onion."),
]
PER_KIND = len(STRUCTURED) // 3

# differently worded records (issue 30, session 21): written after the field drafts
# (decoding/field_drafts.py) to check that the original requests are not tuned to them: the
# fields in another order than the schema's, labels instead of sentences, values before their
# keys, other words for the keys; reported beside the original set (benchmarks/structured.py
# --requests reworded), not part of the bench's `structured` workload
REWORDED = [
    ("extract", PERSON, "Read the note and give me JSON with name, born (year), city and occupation. "
     "Note: In 1879 a boy was born in Ulm; his name was Albert Einstein and he became a theoretical physicist."),
    ("tool", WEATHER_CALL, "Use get_weather. Location = Tokyo. Forecast length: four days (use 4). "
     "Temperature scale: fahrenheit."),
    ("list", SHOPPING, "Our camping trip needs: bread x2, cheese x3, apples x6 and water x4. "
     "Give the JSON shopping list."),
    ("extract", PERSON, "Profile card | Name: Nikola Tesla | Year of birth: 1856 | Hometown: Smiljan | "
     "Job: inventor and electrical engineer. Return the JSON."),
    ("tool", WEATHER_CALL, "My sister lives in Buenos Aires; check the weather there for a week (7 days), "
     "celsius please, with the weather function."),
    ("list", SHOPPING, "For the cake I still have to buy sugar (1 bag), three lemons and a dozen eggs. "
     "JSON list please."),
]

# requests written in session 23 as held out (issue 30) by a helper who had not read the field-draft
# code (structured/, decoding/) nor docs/structured-output.md, worded as users and apps send such
# requests (a CRM export row, an email signature, a wiki infobox, a voice-assistant transcript, a
# chat message with typos, JSON-ish app input, a recipe, a bulleted list, YAML-ish notes): fields
# out of schema order, extra fields, numbers as words. No longer held out: it was read in session 23
# to choose a rule (the own-value-end rule); the name stays. Reported with
# benchmarks/structured.py --requests heldout; UNSEEN below was the held-out set of session 24.
HELDOUT = [
    ("extract", PERSON, "Convert this CRM export row to JSON with name, born, city and occupation.\n"
     "contact_id,full_name,email,job_title,location,dob,tier\n"
     "40213,\"Okafor, Rita\",r.okafor@mailbox.ng,Dental Hygienist,Lagos,1988-04-02,Gold"),
    ("tool", WEATHER_CALL, "Voice assistant transcript, answer with a get_weather call: \"hey um what's "
     "the weather gonna be like in cape town for the next uh ten days, and give it to me in fahrenheit "
     "please\""),
    ("list", SHOPPING, "I'm making guacamole tonight: the recipe says to mash three ripe avocados with the "
     "juice of two limes, one red chili and a bunch of cilantro, then season with sea salt. Can you give "
     "me the shopping list as JSON?"),
    ("extract", PERSON, "Pull the sender's details into JSON (name, born, city, occupation). \"Thanks "
     "again for the site visit, I've lived in Gothenburg since I was born here in 1974 and never seen "
     "a bridge like it.\n--\nJonas Lindqvist\nSenior Structural Engineer | Nordbygg AB\n+46 31 555 0192\""),
    ("tool", WEATHER_CALL, "whats the wether in edinburgh this weekend?? sat and sun so 2 days, in "
     "celcius pls. use the get_weather tool"),
    ("list", SHOPPING, "Groceries for the week, convert to JSON please:\n- oat milk x2\n- 4 chicken "
     "thighs\n- rice (one 1kg bag)\n- spinach\n- coffee beans, 2 packs"),
    ("extract", PERSON, "From this wiki infobox give me the person as JSON with name, born, city and "
     "occupation: {{Infobox person | name = Frida Kahlo | spouse = Diego Rivera | occupation = Painter "
     "| birth_place = Coyoacán, Mexico City | birth_date = {{birth date|1907|7|6}} }}"),
    ("tool", WEATHER_CALL, "Request from the travel app, call get_weather with it: {\"user_id\": 88231, "
     "\"days\": \"six\", \"lang\": \"en\", \"units\": \"F\", \"destination\": \"Reykjavik\"}"),
    ("list", SHOPPING, "party:\n  date: saturday\n  budget: 60 EUR\n  buy:\n    - napkins: 40\n"
     "    - orange juice: 3 cartons\n    - crisps: five bags\n    - ice: 2 bags\n"
     "Make a JSON shopping list out of the buy part."),
]

# held-out requests (issue 30, session 24): written in session 24 by a helper who had not read the
# field-draft code (structured/, decoding/) nor docs/structured-output.md, worded as users and apps
# send such requests and unlike the sets above (a profile bio with the occupation as a verb phrase
# and the city before the name, a news sentence with the year in parentheses, a form dump with
# extra fields, a chat-app message, a calendar invite, a forwarded email, an SMS with
# abbreviations, a meal plan in prose, a markdown table; units and quantities in words and digits).
# Held out from tuning until its first run (the lead, session 24, after every field-draft change of
# the session had landed: docs/structured-output.md "The fresh held-out set"); it has been run now,
# so a change fit to it needs a newer set to be judged on.
UNSEEN = [
    ("extract", PERSON, "Can you turn my LinkedIn About section into JSON with name, born, city and "
     "occupation?\n\"Porto native since 1983, I'm Inês Carvalho. These days I teach chemistry at a public "
     "high school and coach our robotics club on weekends. Always happy to mentor new teachers!\""),
    ("tool", WEATHER_CALL, "Slack message from #offsite-planning, call get_weather for it:\n> *Marta K.*: "
     "hey @weatherbot can u check Kraków for the offsite? we're there tue-fri so 4 days, celsius "
     "obviously :snowflake:"),
    ("list", SHOPPING, "Here's our meal plan for the week, I need the shopping list as JSON. Monday is "
     "lentil soup, so 2 kg of red lentils and five carrots. Wednesday is taco night: a dozen tortillas "
     "and one jar of salsa. Friday we're doing a chickpea curry with two tins of chickpeas."),
    ("extract", PERSON, "Give me the person in this news item as JSON (name, born, city, occupation): "
     "NAIROBI - Wanjiru Kamau (b. 1969), a wildlife veterinarian who has worked in the city for three "
     "decades, was honoured on Tuesday for her care of orphaned elephants."),
    ("tool", WEATHER_CALL, "Get the forecast for this calendar invite with get_weather.\nWhat: Team ski "
     "retreat\nWhen: Fri Dec 18 - Sun Dec 20 (3 days)\nWhere: Zermatt, Switzerland\nOrganizer note: "
     "the US folks asked for temperatures in Fahrenheit"),
    ("list", SHOPPING, "Text from my flatmate, make it a JSON shopping list: \"hey can u grab stuff on ur "
     "way home? 2x toothpaste, dish soap (1 big one), 3 pks AA batteries n a bag of dog food. thx!!\""),
    ("extract", PERSON, "Parse this signup form submission into JSON with name, born, city and occupation:"
     "\nsubmitted_at: 2026-11-30T14:02:11Z\nfirst_name: Minh Chau\nlast_name: Tran\nnewsletter: yes\n"
     "city_of_residence: Da Nang\nyear_of_birth: 1991\nprofession: Paramedic\nreferral: podcast"),
    ("tool", WEATHER_CALL, "Please call get_weather for what Dan asks below.\n---------- Forwarded message "
     "---------\nFrom: Dan Whitfield\nSubject: Re: Marrakech trip\n\nSounds good! Could you check the "
     "weather in Marrakech for the whole trip? We fly back after 8 days. Celsius is fine.\n\n> On Mon, "
     "Priya wrote:\n> booked the riad!"),
    ("list", SHOPPING, "Convert this table from our BBQ planning doc to a JSON shopping list:\n"
     "| item | qty | who |\n|---|---|---|\n| charcoal | 2 bags | Sam |\n| sausages | twenty | Lea |\n"
     "| burger buns | 12 | Lea |\n| corn on the cob | 8 | me |\n| ketchup | one bottle | Sam |"),
]


# held-out requests (issue 30, session 25): written at the start of session 25, before that
# session's field-draft changes landed, by a helper who had not read the field-draft code
# (decoding/field_drafts.py, decoding/json_scan.py) nor docs/structured-output.md's field-draft
# sections; worded as clients send such requests and unlike every set above (an ops log line, a
# German/English CV line, a vCard, an XML record; a CLI invocation, a Spanish request, a
# support ticket, an app deep link; a semicolon CSV export, hardware with units, a formal memo, a
# French/English note), values to normalise (dd/mm/yyyy and compact dates, "imperial", "cinco",
# "a fortnight", "°C", "u=f", quantities as words or with units). The bench's schemas, so its
# figures compare with the other sets'. Held out from tuning until its first run (the lead,
# session 25, after the per-request field gate had landed: docs/structured-output.md "The session
# 25 held-out set"); it has been run now, so a change fit to it needs a newer set to be judged on.
FRESH25 = [
    ("extract", PERSON, "Map the employee in this sync log line to JSON with name, born, city and "
     "occupation:\n2026-11-02T09:14:55Z INFO hr-sync upsert emp_id=5512 name=\"Kwame Mensah\" "
     "dob=14/03/1979 site=KSI-02 city=Kumasi role=\"community pharmacist\" status=active"),
    ("tool", WEATHER_CALL, "Translate this CLI invocation into a get_weather call: "
     "`wx forecast --loc \"Hobart, TAS\" --span 10d --units imperial`"),
    ("list", SHOPPING, "Our shopping app exports this; turn it into the JSON shopping list (item, "
     "quantity):\nitem;qty;unit;aisle\npaper towels;2;rolls;7\nolive oil;1;bottle;3\n"
     "greek yogurt;4;cups;1\ndishwasher tablets;1;box;7"),
    ("extract", PERSON, "Bitte als JSON mit name, born, city und occupation, the values in English "
     "please. Aus dem Lebenslauf: Katharina Vogel, geb. 12.08.1965 in Leipzig. Beruf: Hebamme "
     "(seit 1990)."),
    ("tool", WEATHER_CALL, "Usa la función get_weather, por favor: quiero saber el tiempo en "
     "Montevideo durante los próximos cinco días, en grados centígrados."),
    ("list", SHOPPING, "Hardware run for the shelf project, JSON list please: 3 m of pine board (sold "
     "in 1 m lengths), wood screws 4x40 mm (two boxes), one tube of wood glue, 4 L-brackets."),
    ("extract", PERSON, "Import this contact card as JSON with name, born, city and occupation:\n"
     "BEGIN:VCARD\nVERSION:3.0\nN:Ibarra;Tomás;;;\nFN:Tomás Ibarra\nORG:Taller Ibarra\n"
     "TITLE:Luthier\nADR;TYPE=WORK:;;Calle Condell 1420;Valparaíso;;;Chile\nBDAY:19730521\n"
     "END:VCARD"),
    ("tool", WEATHER_CALL, "Ticket #4471 (priority: low)\nCustomer wrote: \"Off to Queenstown for a "
     "fortnight next month, what's the weather looking like? °C please.\"\nAgent action: answer "
     "with a get_weather call."),
    ("list", SHOPPING, "Dear Facilities team, for the quarterly all-hands we would be grateful if you "
     "could procure the following items: printer paper (10 reams), whiteboard markers (2 boxes), "
     "ring binders (12). Kindly return the order as JSON."),
    ("extract", PERSON, "Convert this record from our legacy HR system to JSON with name, born, city "
     "and occupation:\n<employee id=\"e-2291\"><fullName>Haruki Nakamura</fullName><birthDate>1958-09-30"
     "</birthDate><office city=\"Kanazawa\"/><jobTitle>Ceramics instructor</jobTitle></employee>"),
    ("tool", WEATHER_CALL, "The app opened this deep link, make the matching get_weather call: "
     "weatherapp://forecast?q=Anchorage%2C%20AK&n=3&u=f&ref=homescreen_widget"),
    ("list", SHOPPING, "Liste pour le pique-nique de dimanche, en JSON stp (item + quantity): "
     "3 baguettes, 2 fromages de chèvre, 1 cidre, and some grapes"),
]


# held-out requests (issue 30, session 26): written at the start of session 26, before that
# session's structured-path changes landed, by a helper who had not read the field-draft code
# (decoding/field_drafts.py, field_gate.py, json_scan.py, lazy_mask.py, engine/constrained.py) nor
# docs/structured-output.md's field-draft and gate sections; worded as clients send such requests
# and unlike every set above (YAML front matter, a psql result row, a Japanese/English note, a
# Portuguese support-chat excerpt; a function-calling system prompt, a shipping label, a Dutch
# request, a home-automation rule; a supplier invoice with euro prices, a group chat, a bento
# list with a Japanese word, a recipe to scale), values to normalise (dd/mm/yyyy, "t" for true,
# "metric", "metric_units: false", "vrijdag t/m maandag", a weekday range, "48 h", quantities as
# "x €3.90" lines or "triple it"). The bench's schemas, so its figures compare with the other
# sets'. Two list wordings were changed after a first plain run in which the target ran into the
# 80-token cap on them (the invoice cut from three lines to two; a Japanese list, whose output the
# target filled with invented katakana items, now a bento list in English with one Japanese word,
# the third wording: the second made the target copy the whole request into one item).
# Held out until the lead's first SpecRouter run (session 26, main 02c967d: 1.58x / 1.75x plain +
# jump forward, docs/structured-output.md "The session 26 held-out set"); no longer held out.
FRESH26 = [
    ("extract", PERSON, "Fill name, born, city and occupation as JSON from the author block of this "
     "post:\n---\ntitle: \"Notes from the night shift\"\nauthor: Sipho Ndlovu\nauthor_born: 1977\n"
     "home: Durban\nrole: Air traffic controller\ndraft: false\ntags: [aviation, sleep]\n---"),
    ("tool", WEATHER_CALL, "You are a function-calling assistant. Available tool: get_weather(city: "
     "string, unit: \"celsius\" | \"fahrenheit\", days: integer).\nUser: planning a hike near Banff, "
     "Monday through Thursday. I think in Fahrenheit, sorry!"),
    ("list", SHOPPING, "Turn the lines of this supplier invoice into a JSON shopping list (item, "
     "quantity) for the reorder:\nINV-2026-0912  Lumen SARL\n1. LED bulbs ..... 6 x €3.90 = €23.40\n"
     "2. duct tape ..... 3 x €4.20 = €12.60\nTotal €36.00 (VAT incl.)"),
    ("extract", PERSON, "Here's what `SELECT * FROM members WHERE id = 318;` gave me, as JSON with "
     "name, born, city and occupation please:\n id  | surname | given  | birth_yr | town    | trade  "
     "          | is_active\n-----+---------+--------+----------+---------+------------------+----------"
     "\n 318 | Jansen  | Pieter | 1962     | Utrecht | bicycle mechanic | t\n(1 row)"),
    ("tool", WEATHER_CALL, "Our logistics dashboard needs a get_weather call for the delivery on this "
     "label:\nSHIP TO: Aroha Tane\n14 Kapiti Rd, Wellington 6011, NZ\nPKG 2 of 3 | 4.2 kg | FRAGILE: "
     "yes\nDelivery window: 48 h\nDashboard units: metric"),
    ("list", SHOPPING, "From our camping group chat, make the JSON shopping list:\n[18:41] Joana: "
     "I'll bring the tent\n[18:42] Bram: we still need 2 gas canisters and marshmallows (3 bags?)\n"
     "[18:42] Joana: +1, and one first aid kit\n[18:43] Keiko: mosquito spray x2 pls"),
    ("extract", PERSON, "この人の情報をJSONにしてください (name, born, city, occupation, in English "
     "please): 佐藤美咲 (Misaki Sato)、1994年生まれ、札幌在住。職業は図書館司書です。"),
    ("tool", WEATHER_CALL, "Kun je get_weather aanroepen? We gaan een lang weekend naar Groningen, "
     "vrijdag t/m maandag, en graag in graden Celsius. Dank je!"),
    ("list", SHOPPING, "For tomorrow's bento (お弁当) we need 2 packs of nori, a jar of umeboshi and "
     "edamame, maybe 3 bags. Can I have that as a JSON list?"),
    ("extract", PERSON, "Support chat excerpt, extract the customer as JSON with name, born, city and "
     "occupation:\n[10:02] Agent: Can I confirm your details?\n[10:03] Cliente: sim! Rafael Moreira, "
     "nasci em 15/07/1986, moro em Recife\n[10:03] Cliente: sou enfermeiro, trabalho no turno da noite"),
    ("tool", WEATHER_CALL, "Automation rule fired; emit the get_weather call it asks for.\nalias: "
     "morning_briefing\ntrigger: \"06:30 on weekdays\"\naction:\n  service: weather.get_forecast\n"
     "  data:\n    location: Ushuaia\n    horizon_days: 5\n    metric_units: false"),
    ("list", SHOPPING, "This recipe serves 2 and I'm cooking for 6, so triple it and give me the "
     "shopping list as JSON: 1 aubergine, 2 courgettes, 1 jar of passata."),
]


def schema_valid(doc: str, schema: dict) -> bool:
    """Whether `doc` is JSON that follows `schema` (the subset these schemas use)."""
    def ok(v, s):
        if "const" in s:
            return v == s["const"]
        if "enum" in s:
            return v in s["enum"]
        t = s.get("type")
        if t == "object":
            return (isinstance(v, dict) and set(s.get("required", ())) <= set(v)
                    and (s.get("additionalProperties", True) or set(v) <= set(s["properties"]))
                    and all(ok(v[k], s["properties"].get(k, {})) for k in v))
        if t == "array":
            return (isinstance(v, list) and len(v) <= s.get("maxItems", 1 << 30)
                    and all(ok(x, s.get("items", {})) for x in v))
        if t == "integer":
            return isinstance(v, int) and not isinstance(v, bool)
        if t == "string":
            return isinstance(v, str)
        return t is None
    try:
        return ok(json.loads(doc), schema)
    except ValueError:
        return False
