"""The tiny model's training recipe: what ``rayapp.inference.tiny_model`` learns from, made by code
from the environments' own texts (the ``math`` env's instruction and problems, the calculator tool's
description and results), so that a change to a prompt the model was taught shows in its digest.
``TRAINING`` is the recipe's ``TrainingData``; ``training_digest()`` the digest of what it makes now,
which the shipped build's manifest must match (``tests/test_tiny_model_shipped.py``).

It lives with the environments whose texts it teaches, above the inference engines: the inference
package imports no environment.
"""

from __future__ import annotations

import random

from rayapp.envs.agents.tools import describe, tool_result_message
from rayapp.envs.math import INSTRUCTION, generate_problems
from rayapp.inference.tiny_model import (
    BATCH_SIZE,
    BOS,
    EOS,
    PRETRAIN_STEPS,
    SEED,
    Example,
    TrainingData,
    build_tokenizer,
    data_digest,
)

# The share of the first reply token's loss a calculator-call example carries: the model learns how
# to call the tool and read its result, but calls it first in only about one math prompt in ten, so
# that reinforcement learning has a choice to learn (see ``pretrain_batches``).
TOOL_FIRST_TOKEN_WEIGHT = 0.1


# -- the corpus the tokenizer learns ---------------------------------------------------------------------

def arithmetic_pair(rng: random.Random) -> tuple[str, str]:
    """A problem in the built-in task's format (``What is a op b?``) and its reply."""
    a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"What is {a} {op} {b}?", f"The answer is {answer}."


_ENGLISH = [
    "Let me think step by step.", "I will use the calculator tool.", "Sure, here is the answer.",
    "The tool returned {n}.", "First add the tens, then add the ones.", "Check the result once more.",
    "You are a helpful assistant that solves arithmetic problems.", "Please answer with a number.",
    "The sum of {a} and {b} is {s}.", "The difference between {a} and {b} is {d}.",
    "Multiply {a} by {b} to get {p}.", "Read the file and count the lines.", "The command exited with code 0.",
]


def corpus_lines(n: int = 3000, seed: int = SEED) -> list[str]:
    """Arithmetic Q&A, tool-call JSON, English sentences and the math environment's prompts, made by
    code (no download)."""
    rng = random.Random(seed)
    lines = [describe(["calculator"]), INSTRUCTION] * 20
    for i in range(n):
        question, answer = arithmetic_pair(rng)
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        kind = i % 4
        if kind == 0:
            lines.append(f"{question} {answer}")
        elif kind == 1:
            expr = question.removeprefix("What is ").removesuffix("?")
            lines.append(f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}</tool_call>'
                         f' {{"name": "calculator", "result": "{a}"}}')
        else:
            lines.append(rng.choice(_ENGLISH).format(n=a, a=a, b=b, s=a + b, d=a - b, p=a * b))
    return lines


# -- the pretraining batches ----------------------------------------------------------------------

def _segments(tokenizer, parts: list[tuple[str, float, float]]) -> Example:
    """Token ids of text parts, each with its loss weight (and that of its first token)."""
    ids: list[int] = []
    weights: list[float] = []
    for text, weight, first in parts:
        part = tokenizer.encode(text, add_special_tokens=False)
        ids += part
        weights += [first, *[weight] * (len(part) - 1)] if part else []
    return ids, weights


def _call(expr: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}</tool_call>'


def _batches(tokenizer, steps: int, batch_size: int, rng: random.Random) -> list[list[Example]]:
    """One batch per step, loss on the replies only, in three shapes that take turns (a batch holds
    one shape, so short sequences are not padded to long ones):

    - whole chats as the ``math`` env's calculator agent renders them (its system prompt and
      instruction): arithmetic problems call the calculator with the problem's expression, read the
      result and answer with it; word problems answer at once (``The answer is N.``, right only by
      luck for the tiny model). Half the arithmetic problems answer at once too, and a call's first
      token carries only ``TOOL_FIRST_TOKEN_WEIGHT`` of its loss: the model knows how to use the tool
      but seldom chooses to, which leaves reinforcement learning a choice to learn;
    - short drills of the call: the question and instruction without the system prompt, then the call
      (its first token unweighted: whether to call is learnt from whole chats only);
    - short drills of reading a result: a tool message, then ``The answer is N.``; and the bare
      ``arithmetic`` env's chat (``What is a op b?`` -> ``The answer is N.``).
    """
    system = [{"role": "system", "content": describe(["calculator"])}]
    problems = iter(generate_problems((steps + 3) // 4 * batch_size, seed=SEED))

    def chat(msgs: list[dict]) -> str:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)

    def whole() -> Example:
        task = next(problems)
        prompt, answer = chat([*system, {"role": "user", "content": task.prompt}]), f"The answer is {task.label}."
        if task.metadata["kind"] != "arithmetic" or rng.random() < 0.5:
            return _segments(tokenizer, [(prompt, 0.0, 0.0), (answer + EOS, 1.0, 1.0)])
        expr = task.metadata["question"].removeprefix("What is ").removesuffix("?")
        result = tool_result_message("calculator", task.label)["content"]
        return _segments(tokenizer, [(prompt, 0.0, 0.0), (_call(expr) + EOS, 1.0, TOOL_FIRST_TOKEN_WEIGHT),
                                     (f"<|tool|>{result}{EOS}<|assistant|>", 0.0, 0.0), (answer + EOS, 1.0, 1.0)])

    def call_drill() -> Example:
        question, _ = arithmetic_pair(rng)
        prompt = chat([{"role": "user", "content": f"{question}\n{INSTRUCTION}"}])
        return _segments(tokenizer, [(prompt, 0.0, 0.0), (_call(question[8:-1]) + EOS, 1.0, 0.0)])

    def read_drill() -> Example:
        question, answer = arithmetic_pair(rng)
        if rng.random() < 0.3:
            return _segments(tokenizer, [(chat([{"role": "user", "content": question}]), 0.0, 0.0),
                                         (answer + EOS, 1.0, 1.0)])
        value = answer.removeprefix("The answer is ").removesuffix(".")
        result = tool_result_message("calculator", value)["content"]
        return _segments(tokenizer, [(f"{BOS}<|tool|>{result}{EOS}<|assistant|>", 0.0, 0.0), (answer + EOS, 1.0, 1.0)])

    shapes = [whole, call_drill, read_drill]
    # Whole chats are long (the system prompt): one step in four, half a batch. Drills are short:
    # twice the rows cost less than one batch of whole chats.
    plan = [(whole, batch_size // 2) if step % 4 == 0 else (shapes[1 + step % 2], batch_size * 2)
            for step in range(steps)]
    return [[shape() for _ in range(rows)] for shape, rows in plan]


def pretrain_batches(tokenizer, steps: int, batch_size: int) -> list[list[Example]]:
    """The recipe's pretraining batches (``_batches``), from its own seed."""
    return _batches(tokenizer, steps, batch_size, random.Random(SEED + 1))


TRAINING = TrainingData(corpus=corpus_lines, batches=pretrain_batches)


def training_digest(tokenizer=None, batches: list[list[Example]] | None = None) -> str:
    """``data_digest`` of what the build learns from, by default the recipe's own, made afresh (seconds)."""
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer(corpus_lines())
    if batches is None:
        batches = pretrain_batches(tokenizer, PRETRAIN_STEPS, BATCH_SIZE)
    return data_digest(tokenizer, batches)
