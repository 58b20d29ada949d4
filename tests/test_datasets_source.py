"""MultiDataSource: weighted draws, epochs, the cascade's metadata, exact save/restore."""

import collections
import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayapp.core.cascade import resolve_stopping
from rayapp.envs.datasets import DatasetSpec, MultiDataSource, eval_tasks
from rayapp.types import Sample, StoppingCriteria, Task, TaskConfig


def rows(prefix, n, task_type="t"):
    return [Task(f"{prefix}-{i}", f"q{i}", TaskConfig(task_type), label=str(i), metadata={"row": i})
            for i in range(n)]


def make(seed=0, shuffle=True, weights=(3.0, 1.0, 0.5), sizes=(5, 3, 7)):
    return MultiDataSource([
        DatasetSpec("a", rows("a", sizes[0]), weight=weights[0], dataset_cfg={"max_turns": 5, "temperature": 0.2},
                    n_samples_per_prompt=4, shuffle=shuffle),
        DatasetSpec("b", lambda: rows("b", sizes[1]), weight=weights[1], shuffle=shuffle),
        DatasetSpec("c", rows("c", sizes[2]), weight=weights[2], dataset_cfg={"stop": ["</s>"]}, shuffle=shuffle),
    ], seed=seed)


def key(tasks):
    return [msgspec.to_builtins(t) for t in tasks]


def test_every_task_carries_its_dataset_and_a_copy_of_its_cfg():
    src = make()
    tasks = src.take(40)
    assert len(tasks) == 40
    for t in tasks:
        name = t.metadata["_dataset_name"]
        assert t.task_id.startswith(f"{name}-")
        assert t.metadata["row"] == int(t.label)  # the row's own metadata is kept
        assert t.config.n_samples == (4 if name == "a" else 1)
    a = [t for t in tasks if t.metadata["_dataset_name"] == "a"]
    assert a[0].metadata["_dataset_cfg"] == {"max_turns": 5, "temperature": 0.2}
    a[0].metadata["_dataset_cfg"]["max_turns"] = 99  # a copy: editing one changes no other task
    a[0].config.n_samples = 7
    assert a[1].metadata["_dataset_cfg"]["max_turns"] == 5
    assert src.specs[0].dataset_cfg["max_turns"] == 5
    assert src._rows[0][0].config.n_samples == 1 and "_dataset_name" not in src._rows[0][0].metadata
    c = next(t for t in tasks if t.metadata["_dataset_name"] == "c")
    assert c.metadata["_dataset_cfg"] == {"stop": ["</s>"]}


def test_dataset_cfg_feeds_the_cascade():
    t = next(t for t in make().take(20) if t.metadata["_dataset_name"] == "a")
    sample = Sample(t.task_id, 0, t.prompt, metadata=t.metadata)
    got = resolve_stopping(StoppingCriteria(max_turns=10, max_context_len=64), StoppingCriteria(), sample)
    assert got == StoppingCriteria(max_turns=5, max_context_len=64)


def test_weights_decide_the_mix():
    src = make(weights=(3.0, 1.0, 0.0), sizes=(5, 5, 5))
    counts = collections.Counter(t.metadata["_dataset_name"] for t in src.take(4000))
    assert "c" not in counts  # weight 0: never drawn
    assert 0.70 < counts["a"] / 4000 < 0.80


def test_each_epoch_covers_every_row_once_and_reshuffles():
    src = MultiDataSource([DatasetSpec("a", rows("a", 10))], seed=3)
    epochs = [[t.task_id for t in src.take(10)] for _ in range(3)]
    for ids in epochs:
        assert sorted(ids) == sorted(f"a-{i}" for i in range(10))
    assert len({tuple(ids) for ids in epochs}) == 3  # a fresh order each epoch
    assert [t.metadata["_dataset_epoch"] for t in src.take(11)] == [3] * 10 + [4]


def test_no_shuffle_keeps_row_order_across_epochs():
    src = MultiDataSource([DatasetSpec("a", rows("a", 3), shuffle=False)], seed=3)
    assert [t.task_id for t in src.take(7)] == ["a-0", "a-1", "a-2", "a-0", "a-1", "a-2", "a-0"]


def test_same_seed_same_stream_other_seed_other_stream():
    assert key(make(seed=1).take(30)) == key(make(seed=1).take(30))
    assert key(make(seed=1).take(30)) != key(make(seed=2).take(30))


@settings(max_examples=60, deadline=None)
@given(k=st.integers(0, 40), m=st.integers(0, 40), seed=st.integers(0, 2**32), shuffle=st.booleans(),
       json_trip=st.booleans())
def test_state_restores_exactly(k, m, seed, shuffle, json_trip):
    """Draw k, save, draw m == load into a fresh source, draw m (also through JSON); and the
    stream does not depend on how draws are split."""
    src = make(seed=seed, shuffle=shuffle)
    first = src.take(k)
    state = src.state_dict()
    if json_trip:
        state = json.loads(json.dumps(state))
    after = src.take(m)
    other = make(seed=seed + 1, shuffle=shuffle)  # a different seed: the saved one must win
    other.take(5)
    other.load_state_dict(state)
    assert key(other.take(m)) == key(after)
    assert key(make(seed=seed, shuffle=shuffle).take(k + m)) == key(first + after)


def test_state_dict_is_plain_json_data():
    src = make()
    src.take(9)
    state = src.state_dict()
    assert json.loads(json.dumps(state)) == state  # lists, dicts, ints only: nothing JSON would change
    assert set(state) == {"version", "seed", "rng", "datasets"}
    assert state["datasets"]["a"].keys() == {"epoch", "cursor", "size"}


DELETE = object()


def _bad(state, path, value):
    """A copy of ``state`` with the value at ``path`` replaced, or deleted for DELETE."""
    state = json.loads(json.dumps(state))
    *head, last = path
    node = state
    for p in head:
        node = node[p]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return state


@pytest.mark.parametrize("path,value,needle", [
    (("datasets", "a", "cursor"), "x", '$.datasets.a.cursor: expected int, got "x"'),
    (("datasets", "a", "cursor"), 99, "$.datasets.a.cursor: must be in 0..5"),
    (("datasets", "a", "epoch"), -1, "$.datasets.a.epoch: expected int >= 0, got -1"),
    (("datasets", "b", "size"), 4, "$.datasets.b.size: saved with 4 rows"),
    (("datasets", "a", "cursor"), DELETE, "$.datasets.a.cursor: missing required field"),
    (("datasets", "zz"), {"epoch": 0, "cursor": 0, "size": 1}, "unknown ['zz']"),
    (("datasets", "c"), DELETE, "missing ['c']"),
    (("rng",), [3, [1, 2], None], "$.rng[1]: expected array of length >= 625, got an array of 2 items"),
    (("rng",), [2, [0] * 625, None], "$.rng[0]: expected 3, got 2"),
    (("rng",), [3, [0] * 624 + [625], None], "$.rng[1][624]: expected a position <= 624, got 625"),
    (("rng",), "abc", "$.rng"),
    (("version",), 7, "$.version: expected 1, got 7"),
    (("seed",), None, "$.seed: expected int, got null"),
    (("extra",), 1, '$: unknown field "extra"'),
])
def test_bad_state_names_the_field_and_changes_nothing(path, value, needle):
    src = make()
    src.take(7)
    good = src.state_dict()
    state = _bad(good, path, value)
    with pytest.raises(ValueError) as e:
        src.load_state_dict(state)
    assert needle in str(e.value)
    assert src.state_dict() == good


def test_bad_rng_word_is_named():
    src = make()
    state = src.state_dict()
    state["rng"][1][5] = 2**32
    with pytest.raises(ValueError, match=r"\$\.rng\[1\]\[5\]: expected int >= 0 and <= 4294967295, got 4294967296$"):
        src.load_state_dict(state)


@pytest.mark.parametrize("specs,needle", [
    ([DatasetSpec("a", rows("a", 2), dataset_cfg={"max_turns": "five"})], "dataset 'a'"),
    ([DatasetSpec("a", rows("a", 2), dataset_cfg={"temperature": "hot"})],
     "dataset 'a': $.dataset_cfg.temperature: expected float | null, got \"hot\""),
    ([DatasetSpec("a", rows("a", 2), weight=-1)], "weight"),
    ([DatasetSpec("a", rows("a", 2), weight=float("nan"))], "weight"),
    ([DatasetSpec("a", rows("a", 2), weight=0)], "weight > 0"),
    ([DatasetSpec("a", rows("a", 2), n_samples_per_prompt=0)], "n_samples_per_prompt"),
    ([DatasetSpec("a", [])], "dataset 'a': no rows"),
    ([DatasetSpec("a", ["not a task"])], "row 0 is a str"),
    ([DatasetSpec("a", rows("a", 2)), DatasetSpec("a", rows("b", 2))], "repeated: ['a']"),
    ([], "at least one dataset"),
])
def test_bad_datasets_fail_at_construction(specs, needle):
    with pytest.raises(ValueError) as e:
        MultiDataSource(specs)
    assert needle in str(e.value)


def test_take_rejects_a_bad_count():
    with pytest.raises(ValueError, match="n must be"):
        make().take(-1)
    assert make().take(0) == []


def test_eval_tasks_are_stamped_in_row_order():
    spec = DatasetSpec("ev", rows("e", 5), dataset_cfg={"max_turns": 2}, n_samples_per_prompt=3)
    tasks = eval_tasks(spec, 3)
    assert [t.task_id for t in tasks] == ["e-0", "e-1", "e-2"]
    assert all(t.metadata["_dataset_name"] == "ev" and t.metadata["_dataset_cfg"] == {"max_turns": 2}
               and t.config.n_samples == 3 for t in tasks)
