"""The math environment: arithmetic and word problems, answer extraction, math-verify scoring; a
multi-turn agent with a calculator tool, and its DAgger variant (``ENV``, what recipes name ``math``).

Guarantees:

- ``generate_problems(n, seed)`` is deterministic: problem ``i`` depends on (seed, i) alone, so the
  same arguments give the same tasks in any process, and a prefix of a longer list is the shorter
  list. Every label is the exact integer answer, as a normalised string.
- ``extract_answer`` reads the model's final answer in this order of trust: the last ``\\boxed{..}``,
  the last ``#### N``, the last "answer is N" / "answer: N", else the last number in the text.
  It returns the answer normalised (thousands commas, ``$``, trailing period and zeros after the
  decimal point removed, ``-0`` is ``0``) or None when there is none.
- ``verify`` scores 1.0 exactly when math-verify finds the response's answer equal to the label
  (``rayapp.verify.math_answers``, so ``\\frac{1}{2}`` is 0.5); it never raises on a malformed response (no
  answer, or one it cannot check in time, is a wrong answer). ``extract_answer`` stays for callers
  that want the answer as a string.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

from rayapp.envs.agents.dagger import DAggerAgent
from rayapp.envs.agents.multiturn import ToolAgent
from rayapp.envs.agents.tools import calculator, describe, tool_result_message
from rayapp.envs.protocol import AgentDeps, Env
from rayapp.types import AgentResult, Sample, Task, TaskConfig
from rayapp.verify.math_answers import verify_math

INSTRUCTION = "Solve the problem. End your reply with 'The answer is N.' where N is the final number."

# ---------------------------------------------------------------------------------------------- generation

_NAMES = ["Ann", "Ben", "Chloe", "Dev", "Eva", "Farid", "Grace", "Hugo", "Ines", "Jon", "Kemi", "Liam"]
_ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "books", "shells", "cards"]


def _arithmetic(rng: random.Random) -> tuple[str, int]:
    kind = rng.choice(["+", "-", "*", "/", "mixed"])
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    if kind == "+":
        return f"What is {a} + {b}?", a + b
    if kind == "-":  # b may exceed a: negative answers occur
        return f"What is {a} - {b}?", a - b
    if kind == "*":
        return f"What is {a} * {b}?", a * b
    if kind == "/":  # built from the product, so the quotient is exact
        b = rng.randint(2, 12)
        return f"What is {a * b} / {b}?", a
    c = rng.randint(2, 12)
    return f"What is {a} + {b} * {c}?", a + b * c


def _word(rng: random.Random) -> tuple[str, int]:
    who, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    a, b = rng.randint(5, 60), rng.randint(2, 30)
    kind = rng.randrange(7)
    if kind == 0:
        return f"{who} has {a} {item} and buys {b} more. How many {item} does {who} have now?", a + b
    if kind == 1:
        a = a + b  # keep the answer positive
        return f"{who} had {a} {item} and gave {b} to {other}. How many {item} does {who} have left?", a - b
    if kind == 2:
        a, b = rng.randint(2, 15), rng.randint(2, 15)
        return f"{who} buys {a} packs of {item} with {b} {item} in each pack. How many {item} is that in all?", a * b
    if kind == 3:
        each, friends = rng.randint(2, 15), rng.randint(2, 9)
        return (f"{who} shares {each * friends} {item} equally among {friends} friends. "
                f"How many {item} does each friend get?", each)
    if kind == 4:
        price, count = rng.randint(2, 9), rng.randint(2, 9)
        bill = rng.choice([50, 100])
        return (f"A shop sells {item} for ${price} each. {who} buys {count} and pays with a ${bill} bill. "
                f"How many dollars of change does {who} get?", bill - price * count)
    if kind == 5:
        c = rng.randint(1, a + b)
        return (f"{who} has {a} {item}, finds {b} more, then gives {c} to {other}. "
                f"How many {item} does {who} have now?", a + b - c)
    noon, drop = rng.randint(-5, 20), rng.randint(5, 30)  # the answer is often below zero
    return (f"The temperature was {noon} degrees at noon and dropped by {drop} degrees by midnight. "
            f"What was the temperature at midnight, in degrees?", noon - drop)


GENERATORS: dict[str, Callable[[random.Random], tuple[str, int]]] = {"arithmetic": _arithmetic, "word": _word}


def generate_problems(n: int, seed: int = 0, kinds: tuple[str, ...] = ("arithmetic", "word"), *,
                      task_type: str = "math", n_samples: int = 1, instruction: str | None = INSTRUCTION) -> list[Task]:
    """``n`` problems, kinds in turn (problem i is ``kinds[i % len(kinds)]``)."""
    unknown = [k for k in kinds if k not in GENERATORS]
    if unknown or not kinds:
        raise ValueError(f"unknown problem kinds {unknown or kinds!r}; known: {sorted(GENERATORS)}")
    tasks = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        # A string seed hashes stably (sha512), unlike hash(): the same problem in every process.
        question, answer = GENERATORS[kind](random.Random(f"math:{seed}:{i}"))
        tasks.append(Task(f"math-{seed}-{i}", _prompt(question, instruction),
                          TaskConfig(task_type, n_samples=n_samples), label=str(answer),
                          metadata={"question": question, "kind": kind}))
    return tasks


def _prompt(question: str, instruction: str | None) -> str:
    return f"{question}\n{instruction}" if instruction else question


# ---------------------------------------------------------------------------------------------- answers

# A minus sign counts only when no word character precedes it, so "3-5" reads 5 but "x = -5" reads -5.
_NUM = r"(?:(?<![\w.])[-\u2212])?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUM_RE = re.compile(_NUM)
_HASHES = re.compile(r"####\s*(" + _NUM + ")")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*\**\s*(" + _NUM + ")", re.I)


def normalize(text: str) -> str:
    """The canonical form exact match compares: a number as its shortest decimal, else the text
    lower-cased with whitespace collapsed and a trailing period dropped."""
    s = text.strip().replace("\u2212", "-").rstrip(".").strip()
    num = s.replace(",", "").replace("$", "").replace(" ", "")
    try:
        d = Decimal(num)
    except InvalidOperation:
        return " ".join(s.lower().split())
    if not d.is_finite():
        return " ".join(s.lower().split())
    if d == d.to_integral_value():
        return str(int(d))  # also turns -0 into 0 and 12.00 into 12
    return format(d.normalize(), "f")


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces matched (answers like ``\\frac{1}{2}`` nest)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced: the response was cut off inside the box


def extract_answer(text: str | None) -> str | None:
    if not text:
        return None
    boxed = _boxed(text)
    if boxed is not None:
        nums = _NUM_RE.findall(boxed)
        # A box holding exactly one number is that number; anything else is compared as text.
        return normalize(nums[0]) if len(nums) == 1 else normalize(boxed)
    for pattern in (_HASHES, _ANSWER_IS):
        found = pattern.findall(text)
        if found:
            return normalize(found[-1])
    nums = _NUM_RE.findall(text)
    return normalize(nums[-1]) if nums else None


def verify(sample: Sample, result: AgentResult) -> dict[str, float]:
    """The response's answer against the label (the reference answer, str or number) by math-verify
    (``rayapp.verify.math_answers``: ``\\frac{1}{2}`` equals 0.5, ``\\sqrt{2}``, tuples, choices), in a
    killable child process: an answer it cannot check in time scores 0."""
    return {"score": 1.0 if verify_math(result.response or "", str(sample.label)) else 0.0}


# ---------------------------------------------------------------------------------------------- environment


def rows(cfg) -> list[Task]:
    return generate_problems(cfg.n_prompts, cfg.seed)


def tool_result_rows(cfg) -> list[Task]:
    """Arithmetic problems picked up after the calculator answered: each prompt is the chat so far (the
    agent's system prompt, the problem, the assistant's calculator call, the tool's result), and the reply
    due is ``The answer is N.``. A dataset's ``source`` (``rayapp.envs.math:tool_result_rows``) for the
    math env: the task the tiny CPU model does solve (it was taught to read a result back; it cannot do
    the arithmetic itself, and calls the calculator of its own accord in about one prompt in ten)."""
    tasks, i = [], 0
    while len(tasks) < cfg.n_prompts:
        question, answer = _arithmetic(random.Random(f"math-read:{cfg.seed}:{i}"))
        expr = question.removeprefix("What is ").removesuffix("?")
        call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}</tool_call>'
        prompt = [{"role": "system", "content": describe(["calculator"])},
                  {"role": "user", "content": _prompt(question, INSTRUCTION)},
                  {"role": "assistant", "content": call}, tool_result_message("calculator", str(answer))]
        tasks.append(Task(f"math-read-{cfg.seed}-{i}", prompt, TaskConfig("math"), label=str(answer),
                          metadata={"question": question, "kind": "tool_result"}))
        i += 1
    return tasks


def make_agent(deps: AgentDeps) -> ToolAgent:
    return ToolAgent(deps.engine, deps.verify, tools=deps.tools, executor=deps.executor)


def make_dagger_agent(deps: AgentDeps) -> DAggerAgent:
    return DAggerAgent(deps.engine, deps.teacher, deps.verify, tools=deps.tools, executor=deps.executor)


ENV = Env("math", rows, make_agent, make_dagger_agent, verify=verify, tools={"calculator": calculator})
