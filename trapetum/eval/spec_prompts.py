"""The prompt set of the speculative decoding benchmark's real-model part (bench_spec.py), four kinds, three each:

    edit       rewrite / fix / reformat a passage given in the prompt (chat template): the answer copies much of it
    summarize  summarize or answer from a given passage (chat template): some copying
    code       complete Python code with repeated identifiers (raw continuation, no template)
    continue   continue a text (raw continuation): Tiny Shakespeare (public domain) and an invented report

The passages and code were written for this benchmark (Shakespeare excepted). ``PROMPTS``: (kind, name, chat,
text); chat prompts are one user message in the model's chat template.
"""
from __future__ import annotations

PASSAGE = (
    "The river town of Elmsford grew up around a wooden bridge built in 1742. For a century the bridge was the only "
    "crossing for thirty miles, and every cart of wool, grain and timber paid a toll to cross it. When the railway "
    "arrived in 1851 the tolls collapsed, the mills moved closer to the station, and the old market square emptied. "
    "Today the bridge is a footpath, the mills are apartments, and the square holds a farmers' market every Saturday."
)

TYPOS = (
    "Our team have finished the migraton of the billing servise to the new databse. The old servers will be "
    "switched of on friday, and all invoices created after monday will be stored in the new sytem. If you see "
    "any diference between the old and new invoices, please report it to the billing team imediately."
)

CODE_1 = '''class Inventory:
    def __init__(self):
        self.items = {}

    def add_item(self, name, quantity, price):
        if name in self.items:
            self.items[name]["quantity"] += quantity
        else:
            self.items[name] = {"quantity": quantity, "price": price}

    def remove_item(self, name, quantity):
        if name not in self.items:
            raise KeyError(name)
'''

CODE_2 = '''def parse_config(lines):
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config


def parse_headers(lines):
    headers = {}
    for line in lines:
'''

CODE_3 = '''import math


def vector_add(a, b):
    return [x + y for x, y in zip(a, b)]


def vector_sub(a, b):
    return [x - y for x, y in zip(a, b)]


def vector_mul(a, s):
'''

SHAKESPEARE = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\nFirst Citizen:\n"
    "You are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n\nFirst Citizen:\n"
    "First, you know Caius Marcius is chief enemy to the people.\n\nAll:\nWe know't, we know't.\n\nFirst Citizen:\n"
)

REPORT = (
    "Quarterly report, northern region. Sales of the X200 rose 12 percent over the quarter, sales of the X300 rose "
    "8 percent, and sales of the X400 fell 3 percent. In the southern region, sales of the X200 rose"
)

PROMPTS: list[tuple[str, str, bool, str]] = [
    ("edit", "fix-typos", True, "Rewrite the following text with the spelling mistakes corrected. Keep everything "
                                "else the same.\n\n" + TYPOS),
    ("edit", "past-tense", True, "Rewrite the following passage in the first person plural, as if the town's "
                                 "people were telling it.\n\n" + PASSAGE),
    ("edit", "bullets", True, "Turn the following passage into a bulleted list of facts, one sentence per "
                              "bullet, keeping the original wording.\n\n" + PASSAGE),
    ("summarize", "summary", True, "Summarize the following passage in two sentences.\n\n" + PASSAGE),
    ("summarize", "question", True, "Read the passage and answer: why did the tolls collapse?\n\n" + PASSAGE),
    ("summarize", "email", True, "Write a short reply to this message, quoting the date the old servers are "
                                 "switched off.\n\n" + TYPOS),
    ("code", "inventory", False, CODE_1),
    ("code", "parsers", False, CODE_2),
    ("code", "vectors", False, CODE_3),
    ("continue", "shakespeare", False, SHAKESPEARE),
    ("continue", "report", False, REPORT),
    ("continue", "bridge", False, PASSAGE + " The bridge"),
]


def encode(model, chat: bool, text: str) -> list[int]:
    """Token ids of a prompt for ``model`` (api.Model): the chat template for chat prompts when the model has one."""
    if chat and model.tokenizer is not None and model.tokenizer.chat_template:
        return model.encode_chat([{"role": "user", "content": text}])
    return model.encode(text)
