"""Natural training prompts made on this machine, nothing downloaded: tasks seeded from text that was already here
(docstrings and source of the Python standard library and of installed packages such as numpy and torch, and the
package descriptions in their metadata; a snapshot kept in the repository, :data:`SEED_TEXTS_PATH`), phrased in many styles (questions, instructions, rewrites, summaries,
lists, code review and completion, maths word problems of varied structure, everyday requests, creative writing,
multi-turn follow-ups), with varied lengths and system prompts; plus the train side of the target's own
self-generated prompts (:mod:`dflash_apps.train.self_prompts`) when a prompts file is given.

A prompt is either a plain user text (the chat template's default system prompt) or a conversation: a list of
``{"role", "content"}`` messages ending with a user turn (:func:`is_conversation`). :func:`build_natural_mix` is
deterministic in its seed, size and self-prompts file (a longer mix extends a shorter one: seeded prompt ``i``
depends on ``seed`` and ``i`` only), deduplicated (:func:`dflash_apps.train.self_prompts.dedup_key` of the user turns),
filtered (length, mostly ASCII) and never holds a prompt of the hand-written natural evaluation set nor a near copy
of one (:func:`near_eval_copy`: the same words, the eval prompt's words inside it, or a shared run of
:data:`SHINGLE_WORDS` words).
"""
from __future__ import annotations

import ast
import glob
import hashlib
import json
import lzma
import os
import random
import re
import sysconfig
import textwrap
from functools import lru_cache
from typing import Union

Message = dict
Prompt = Union[str, list]  # a user text, or a conversation (list of messages)

SHINGLE_WORDS = 8
EVAL_FRACTION = 0.05  # held-out side of the seeded prompts (the self prompts keep their own split)
MIN_CHARS, MAX_CHARS = 8, 2400
# kind -> share of the mix (the self-generated prompts come on top, see build_natural_mix)
MIX = (("doc task", 0.24), ("code task", 0.16), ("maths", 0.18), ("everyday", 0.24), ("multi-turn", 0.18))
DEFAULT_SYSTEM_SHARE = 0.55  # the rest get one of SYSTEM_PROMPTS (the self-prompt ones plus terse instructions)
EXTRA_SYSTEM_PROMPTS = [
    "Answer briefly.",
    "You are a concise assistant. Keep answers under 100 words.",
    "You are a helpful assistant. Explain your reasoning step by step.",
    "You are a friendly assistant for a small business owner.",
    "You are a tutor for university students.",
]


def is_conversation(prompt: Prompt) -> bool:
    """Whether ``prompt`` is a conversation (a list of messages) rather than one user text."""
    return isinstance(prompt, list)


def check_prompt(prompt: Prompt, where: str = "prompt") -> None:
    """A ValueError naming ``where`` unless ``prompt`` is a non-empty string or a list of ``{"role", "content"}``
    messages (roles system/user/assistant, a system message only first) ending with a user turn."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{where}: an empty user text")
        return
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{where}: a prompt is a user text or a non-empty list of messages, got {type(prompt).__name__}")
    for j, m in enumerate(prompt):
        if not (isinstance(m, dict) and set(m) == {"role", "content"} and isinstance(m["content"], str)
                and m["role"] in ("system", "user", "assistant") and (m["role"] != "system" or j == 0)):
            raise ValueError(f"{where}: message {j} must be {{'role': system (first only)|user|assistant, "
                             f"'content': str}}, got {m!r}")
    if prompt[-1]["role"] != "user":
        raise ValueError(f"{where}: a conversation must end with a user turn")


def prompt_text(prompt: Prompt) -> str:
    """The text a prompt is keyed by: the user text itself, or the conversation as canonical JSON."""
    return json.dumps(prompt, ensure_ascii=False, sort_keys=True) if is_conversation(prompt) else prompt


def prompt_messages(prompt: Prompt) -> list[Message]:
    """The prompt as chat messages (a user text: one user turn, the template's default system prompt)."""
    return list(prompt) if is_conversation(prompt) else [{"role": "user", "content": prompt}]


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """The token ids the target continues: ``prompt``'s messages through the chat template, assistant header
    appended (a user text gets the template's default system prompt, as :func:`dflash_apps.smollm2.chat_prompt`)."""
    text = tokenizer.apply_chat_template(prompt_messages(prompt), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def user_text(prompt: Prompt) -> str:
    """All user turns of a prompt, joined: what deduplication and the eval-copy check look at."""
    return "\n".join(m["content"] for m in prompt_messages(prompt) if m["role"] == "user")


# ---------------------------------------------------------------------------------------------------- seed text
def _site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def _python_files() -> list[str]:
    """Source files whose docstrings seed tasks: the stdlib's top level and a few documented package folders."""
    sp = _site_packages()
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    for pattern in ("numpy/*.py", "numpy/lib/*.py", "numpy/_core/*.py", "numpy/linalg/*.py", "numpy/random/*.py",
                    "torch/nn/modules/*.py", "torch/optim/*.py", "torch/utils/data/*.py", "torch/nn/functional.py",
                    "jinja2/*.py", "sympy/core/*.py", "tqdm/*.py", "yaml/*.py", "psutil/*.py"):
        files += sorted(glob.glob(os.path.join(sp, pattern)))
    return [f for f in files if "/test" not in f]


def _prose(doc: str) -> str | None:
    """The first paragraphs of a docstring if they read as prose (no doctest, parameter table or markup soup)."""
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", doc.strip())]
    out = []
    for p in paras:
        if not p or p.startswith((">>>", "..", ":", "Parameters", "Returns", "Examples", "See Also", "Notes", "---")):
            break
        out.append(p)
        if sum(len(x) for x in out) > 300:
            break
    text = " ".join(out)
    letters = sum(c.isalpha() or c == " " for c in text)
    if not 80 <= len(text) <= 900 or letters < 0.85 * len(text) or text.count(" ") < 12:
        return None
    return text


SeedTexts = tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]


def scan_seed_texts() -> SeedTexts:
    """``(docs, functions)`` of this environment: ``(name, prose)`` docstring paragraphs and ``(name, source)``
    short functions with a docstring, from :func:`_python_files` (parsed, never imported), plus package
    descriptions from metadata. What :data:`SEED_TEXTS_PATH` was made from (:func:`save_seed_texts`); not read
    by :func:`build_natural_mix` directly, because it changes with every installed package version (and with this
    project's README, which is its own package description), and the mix must not."""
    docs, funcs = [], []
    for path in _python_files():
        try:
            with open(path, encoding="utf-8") as f:
                src = f.read()
            tree = ast.parse(src)
            lines = src.splitlines()
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        mod = os.path.splitext(os.path.basename(path))[0]
        doc = ast.get_docstring(tree)
        if doc and (p := _prose(doc)):
            docs.append((mod, p))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if doc and (p := _prose(doc)):
                docs.append((f"{mod}.{node.name}", p))
            if isinstance(node, ast.FunctionDef) and doc and 4 <= node.end_lineno - node.lineno <= 24:
                seg = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
                if len(seg) < 1100 and seg.isascii() and seg.startswith("def "):
                    funcs.append((f"{mod}.{node.name}", seg))
    for meta in sorted(glob.glob(os.path.join(_site_packages(), "*.dist-info", "METADATA"))):
        with open(meta, encoding="utf-8", errors="replace") as f:
            body = f.read().split("\n\n", 1)[-1]
        name = os.path.basename(os.path.dirname(meta)).split("-")[0]
        for para in re.split(r"\n\s*\n", body)[:12]:
            if (p := _prose(para)) and "http" not in p:
                docs.append((name, p))
    return tuple(docs), tuple(funcs)


SEED_TEXTS_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                               "natural-mix-seed-texts.json.xz")


def save_seed_texts(path: str, texts: SeedTexts) -> None:
    """Write ``(docs, functions)`` (:func:`scan_seed_texts`) as lzma-compressed JSON, the format
    :func:`load_seed_texts` reads."""
    docs, funcs = texts
    with lzma.open(path, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as f:
        json.dump({"docs": [list(d) for d in docs], "functions": [list(fn) for fn in funcs]}, f, ensure_ascii=False)


def load_seed_texts(path: str) -> SeedTexts:
    """The ``(docs, functions)`` saved by :func:`save_seed_texts`; a ValueError naming ``path`` when the file is not
    in that format."""
    with lzma.open(path, "rt", encoding="utf-8") as f:
        raw = json.load(f)
    pairs = []
    for part in ("docs", "functions"):
        rows = raw.get(part) if isinstance(raw, dict) else None
        if not isinstance(rows, list) or not all(
                isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) for x in r) for r in rows):
            raise ValueError(f"{path}: not a seed-texts file ('{part}' must be a list of [name, text] pairs)")
        pairs.append(tuple(tuple(r) for r in rows))
    return pairs[0], pairs[1]


@lru_cache(maxsize=1)
def seed_texts() -> SeedTexts:
    """The seed texts of the mix: :data:`SEED_TEXTS_PATH`, a snapshot of :func:`scan_seed_texts` kept in the
    repository, so that the mix (hence the prompt order of data shards already generated) is the same in every
    environment."""
    return load_seed_texts(SEED_TEXTS_PATH)


# ---------------------------------------------------------------------------------------------------- phrasings
def _pick(rng: random.Random, options):
    return options[rng.randrange(len(options))]


def _doc_task(rng: random.Random, name: str, text: str) -> str:
    short = name.split(".")[-1]
    forms = [
        f"Summarize this in one sentence:\n\n{text}",
        f"Can you explain this to a beginner?\n\n{text}",
        f"Rewrite the following paragraph in plain English, without jargon:\n\n{text}",
        f"Turn this description into three bullet points:\n\n{text}",
        f"What is the main idea of this text?\n\n\"{text}\"",
        f"Here is some documentation I found:\n{text}\n\nWhat would I use this for? Give an example.",
        f"Write two quiz questions (with answers) based on this paragraph:\n\n{text}",
        f"Make this shorter, at most 30 words:\n\n{text}",
        f"Translate into Spanish:\n\n{text}",
        f"Give this paragraph a short title.\n\n{text}",
        f"I don't understand this part of the docs for `{short}`:\n> {text}\nwhat does it mean?",
        f"{text}\n\nExplain the above like I'm twelve.",
        f"List the technical terms in this text and define each one briefly:\n\n{text}",
        f"Rewrite this in a more formal tone:\n\n{text}",
        f"Is this description clear? Suggest how to improve it.\n\n{text}",
        f"what is `{name}` in python and when should I use it",
        f"How do I use `{name}`? Show a short example.",
    ]
    return _pick(rng, forms)


_LANGS = ["JavaScript", "Java", "C", "Go", "Rust", "TypeScript", "C++"]


def _code_task(rng: random.Random, name: str, src: str) -> str:
    fence = f"```python\n{src}\n```"
    stub = src.split('"""')[0] + ('"""' + src.split('"""')[1] + '"""\n' if src.count('"""') >= 2 else "")
    forms = [
        f"What does this function do?\n\n{fence}",
        f"Explain this code line by line:\n{fence}",
        f"Add type hints to this function:\n\n{fence}",
        f"Write unit tests (pytest) for this function:\n\n{fence}",
        f"Can you review this code and suggest improvements?\n\n{fence}",
        f"Rewrite this in {_pick(rng, _LANGS)}:\n\n{fence}",
        f"Is there a bug in this code? {fence}",
        f"Complete this function:\n\n{stub}",
        f"Simplify this code if you can, and explain what you changed.\n{fence}",
        f"Write a docstring in Google style for this function:\n\n{fence}",
        f"{fence}\nWhat is the time complexity of this?",
        f"I found `{name}` in a library. How would I call it? Here is its source:\n{fence}",
    ]
    return _pick(rng, forms)


_NAMES = ["Ana", "Bilal", "Chen", "Dora", "Elias", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena", "Mateo",
          "Nia", "Oscar", "Priya", "Ravi", "Sofia", "Tom", "Uma", "Victor", "Wanda", "Xin", "Yara"]
_PLACES = ["a bakery", "a bookshop", "a farm", "a school", "a factory", "a cafe", "a library", "a garden centre",
           "a cinema", "a bike shop"]
_GOODS = [("muffin", "muffins"), ("ticket", "tickets"), ("bag of rice", "bags of rice"), ("notebook", "notebooks"),
          ("plant", "plants"), ("T-shirt", "T-shirts"), ("jar of honey", "jars of honey"), ("pizza", "pizzas")]


def _maths(rng: random.Random) -> str:
    n1, n2 = rng.sample(_NAMES, 2)
    place = _pick(rng, _PLACES)
    one, many = _pick(rng, _GOODS)
    a, b, c = rng.randint(2, 90), rng.randint(2, 40), rng.randint(2, 15)
    p = rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 75])
    price = rng.choice([0.5, 1.25, 2, 2.5, 3.75, 4, 6.5, 12, 19.99])
    speed, hours = rng.randint(20, 120), rng.choice([1.5, 2, 2.5, 3, 4])
    forms = [
        f"{place.capitalize()} sold {a} {many} on Monday and {p}% more on Tuesday. How many {many} did it sell over "
        f"both days?",
        f"If one {one} costs ${price}, how much do {c} {many} cost, and how much change is left from $100?",
        f"I drive at {speed} km/h for {hours} hours, then at {speed // 2} km/h for {c} more hours. What is my average "
        f"speed for the whole trip?",
        f"{n1} can paint a fence in {c} hours and {n2} can paint it in {c + b % 7 + 1} hours. How long do they take "
        f"working together?",
        f"A jacket costs ${a + 20}. It is on sale for {p}% off, and then there is a {rng.choice([5, 8, 10])}% sales tax "
        f"on the sale price. What do I pay?",
        f"{n1} is {c} times as old as {n2}. In {b} years {n1} will be twice as old as {n2}. How old are they now?",
        f"What is {p}% of {a * 4}?",
        f"Convert {a} miles to kilometres and {b} pounds to kilograms.",
        f"The ratio of cats to dogs at a shelter is {c}:{b % 9 + 1}. There are {(b % 9 + 1) * 3} dogs. How many cats?",
        f"A recipe for {c} people needs {b * 25} g of flour. How much flour do I need for {c + a % 5 + 1} people?",
        f"My scores so far are {a}, {b + 50}, {min(99, a + c)} and {b + 40}. What do I need on the next test to "
        f"average {p + 50}?",
        f"Solve: {c}x - {b} = {a}. Show each step.",
        f"Find the area of a circle with a radius of {c} cm, and its circumference.",
        f"A tank holds {a * 10} litres. It fills at {b} litres per minute and leaks {c % b + 1} litres per minute. "
        f"How long until it is full?",
        f"If I invest ${a * 100} at {c % 8 + 1}% interest compounded yearly, how much will I have after {c} years?",
        f"There are {a + b} students; {a} play football, {b + c} play chess and {c} play both. How many play "
        f"neither?",
        f"{n1} bought {c} {many} at {place} and paid ${c * price:.2f}. {n2} bought {c + 2} {many}. How much did "
        f"{n2} pay?",
        f"Is {a * b + 1} a prime number? Explain how you check.",
        f"A train leaves at 9:{b % 60:02d} and the trip takes {c} hours {a % 60} minutes. When does it arrive?",
        f"What is the probability of rolling a total of {c % 11 + 2} with two dice?",
    ]
    tail = _pick(rng, ["", "", "", " Explain briefly.", " Just give the answer.", " Please show your working.",
                       " Can you explain it like I'm 10?"])
    return _pick(rng, forms) + tail


_SUBJECTS = ["my sister's birthday", "a job interview", "a first marathon", "learning the guitar", "a move to a new "
             "city", "saving for a car", "a school science fair", "a camping weekend", "a team meeting", "remote "
             "work", "a vegetable garden", "a rainy day", "an old lighthouse", "a lost dog", "the first day of "
             "spring", "a late train", "a small coffee shop", "a dragon who is afraid of fire", "my grandmother's "
             "kitchen", "a robot learning to dance", "a city at night", "autumn leaves", "the ocean", "a chess game",
             "a broken phone", "a video game launch", "a volunteer project", "a neighbourhood clean-up"]
_PHENOMENA = ["the tides", "ice floating on water", "bread rising", "thunder after lightning", "leaves changing "
              "colour", "yawning", "jet lag", "rust", "static electricity", "soap cleaning grease", "a rainbow",
              "hiccups", "the northern lights", "compound interest", "inflation", "vaccines", "noise-cancelling "
              "headphones", "GPS", "a refrigerator", "muscle soreness after exercise", "caffeine", "sourdough",
              "tsunamis", "bird migration", "solar panels", "Wi-Fi", "time zones", "leap years"]
_PEOPLE = ["my manager", "a client", "my landlord", "a teacher", "my neighbour", "a hotel", "customer support",
           "a colleague", "a friend I haven't seen in years", "the school principal"]
_ABOUTS = ["a late payment", "rescheduling a meeting", "a refund for a damaged order", "asking for a day off",
           "thanking them for their help", "a noise complaint", "a reference letter", "a project delay",
           "cancelling a booking", "an invitation to a party"]


def _everyday(rng: random.Random) -> str:
    s, ph, who, about = _pick(rng, _SUBJECTS), _pick(rng, _PHENOMENA), _pick(rng, _PEOPLE), _pick(rng, _ABOUTS)
    n = rng.choice([3, 4, 5, 7, 10])
    forms = [
        f"Write a short poem about {s}.", f"Write a haiku about {s}.", f"Tell me a very short story about {s}.",
        f"Write a limerick about {s}.", f"What causes {ph}?", f"What's the science behind {ph}?", f"explain {ph} simply",
        f"Can you write an email to {who} about {about}?", f"Draft a polite message to {who} about {about}.",
        f"Give me {n} tips for {s}.", f"List {n} ideas for {s}.", f"What should I pack for {s}?",
        f"Help me plan {s}. I have a small budget.", f"What are the pros and cons of {s}?",
        f"I'm nervous about {s}. Any advice?", f"Write a text message to {who}: {about}. Keep it friendly.",
        f"Compare {ph} and {_pick(rng, _PHENOMENA)} in a short table.",
        f"Write a product description for a mug that celebrates {s}.", f"Give me a catchy title for a blog post "
        f"about {s}.", f"What's a fun fact about {ph}?", f"Write a tweet about {s}.",
        f"Make a {n}-day plan for {s}.", "hello!", "thanks, that helped a lot", "Can you help me with something?",
        f"Write a short speech for {s}.", f"Describe {s} using all five senses.",
        f"Is it true that {ph} is caused by the moon?", f"Summarize the history of {ph} in {n} sentences.",
    ]
    return _pick(rng, forms)


_FOLLOW_UPS = ["Can you make it shorter?", "Thanks! Can you give me an example?", "Why?", "Can you explain that "
               "more simply?", "What about the opposite case?", "Now write it as a bulleted list.", "Great. Can you "
               "add one more point?", "ok and how would I do that in practice?", "Can you make it more formal?",
               "Could you put that in a table?", "What is a common mistake people make here?"]


def _multi_turn(rng: random.Random, docs, funcs) -> list[Message]:
    kind = rng.randrange(3)
    if kind == 0 and docs:
        name, text = _pick(rng, docs)
        first = f"What does `{name}` do?"
        answer = text
    elif kind == 1 and funcs:
        name, src = _pick(rng, funcs)
        first = f"Show me the source of {name.split('.')[-1]}."
        answer = f"Here it is:\n\n```python\n{src}\n```"
    else:
        first = _everyday(rng)
        answer = "Sure! " + _pick(rng, ["Here are a few ideas to start with.", "Happy to help with that.",
                                        "Let me know if you want more detail."])
    follow = _pick(rng, _FOLLOW_UPS + ([f"How would I write that in {_pick(rng, _LANGS)}?", "Add comments to it.",
                                        "Can you write a test for it?"] if kind == 1 else []))
    return [{"role": "user", "content": first}, {"role": "assistant", "content": answer},
            {"role": "user", "content": follow}]


def _system_prompts() -> list[str]:
    from dflash_apps.train.self_prompts import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS[1:] + EXTRA_SYSTEM_PROMPTS  # [0] is the template's default


def _with_system(rng: random.Random, prompt: Prompt) -> Prompt:
    if rng.random() < DEFAULT_SYSTEM_SHARE:
        return prompt
    return [{"role": "system", "content": _pick(rng, _system_prompts())}] + prompt_messages(prompt)


# ---------------------------------------------------------------------------------------------------- filtering
def _words(text: str) -> list[str]:
    from dflash_apps.train.self_prompts import dedup_key

    return dedup_key(text).split()


class EvalCopyCheck:
    """Whether a text is a near copy of a hand-written natural evaluation prompt (see :func:`near_eval_copy`)."""

    def __init__(self, eval_prompts: list[str]):
        self.keys = [" ".join(_words(p)) for p in eval_prompts]
        self.shingles = {tuple(w[i:i + SHINGLE_WORDS]) for w in map(str.split, self.keys)
                         for i in range(len(w) - SHINGLE_WORDS + 1)}

    def __call__(self, text: str) -> bool:
        w = _words(text)
        key = " ".join(w)
        if any(k and (k == key or f" {k} " in f" {key} ") for k in self.keys):
            return True
        return any(tuple(w[i:i + SHINGLE_WORDS]) in self.shingles for i in range(len(w) - SHINGLE_WORDS + 1))


@lru_cache(maxsize=1)
def _eval_check() -> EvalCopyCheck:
    from dflash_apps.train.natural_prompts import natural_eval_prompts

    return EvalCopyCheck(natural_eval_prompts())


def near_eval_copy(text: str) -> bool:
    """True when ``text`` is a natural evaluation prompt or a near copy: the same words (case, punctuation and
    spacing ignored), an eval prompt's whole wording inside it, or a shared run of :data:`SHINGLE_WORDS` words."""
    return _eval_check()(text)


def _acceptable(prompt: Prompt) -> bool:
    from dflash_apps.train.self_prompts import mostly_ascii

    text = user_text(prompt)
    return MIN_CHARS <= len(text) <= MAX_CHARS and mostly_ascii(text) and not near_eval_copy(text)


def _candidate(seed: int, index: int, docs, funcs) -> tuple[str, Prompt]:
    rng = random.Random(hashlib.sha256(f"natural-mix-{seed}-{index}".encode()).digest())
    kind = rng.choices([k for k, _ in MIX], [w for _, w in MIX])[0]
    if kind == "doc task" and docs:
        prompt: Prompt = _doc_task(rng, *_pick(rng, docs))
    elif kind == "code task" and funcs:
        prompt = _code_task(rng, *_pick(rng, funcs))
    elif kind == "maths":
        prompt = _maths(rng)
    elif kind == "multi-turn":
        prompt = _multi_turn(rng, docs, funcs)
    else:
        kind, prompt = "everyday", _everyday(rng)
    return kind, _with_system(rng, prompt)


def build_natural_mix(n: int, split: str = "train", seed: int = 0,
                      self_prompts_path: str | None = None) -> list[tuple[str, Prompt]]:
    """``split``'s side ("train" or "eval") of the self-generated prompts of ``self_prompts_path`` when given
    (kind ``"self"``, each after the system prompt it was sampled under; first, so that a data run reaches them
    early: a grown self-prompts file shifts the seeded prompts after them), then ``n`` seeded prompts of ``split``
    (the hash split of :func:`dflash_apps.train.prompts.split_of` at :data:`EVAL_FRACTION` of the user turns'
    dedup key, so a user text is on one side only, whatever its system prompt), each as ``(kind, prompt)`` (kinds
    of :data:`MIX`); deduplicated across both, filtered, no natural-eval prompt nor near copy (module docstring)."""
    from dflash_apps.train.prompts import split_of
    from dflash_apps.train.self_prompts import dedup_key

    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    docs, funcs = seed_texts()
    seen: set[str] = set()
    out: list[tuple[str, Prompt]] = []

    def add(kind: str, prompt: Prompt) -> None:
        key = dedup_key(user_text(prompt))
        if key not in seen and _acceptable(prompt):
            seen.add(key)
            out.append((kind, prompt))

    if self_prompts_path:
        from dflash_apps.train.self_prompts import self_prompt_records

        for system, text in self_prompt_records(self_prompts_path, split=split):
            add("self", [{"role": "system", "content": system}, {"role": "user", "content": text}])
    n += len(out)
    index, limit = 0, (50 * n + 100) * (20 if split == "eval" else 2)
    while len(out) < n and index < limit:
        kind, prompt = _candidate(seed, index, docs, funcs)
        if split_of(dedup_key(user_text(prompt)), EVAL_FRACTION) == split:
            add(kind, prompt)
        index += 1
    return out
