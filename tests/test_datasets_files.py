"""data.<name>.path: JSONL and Parquet files mapped onto Tasks; a bad row is one DatasetError naming
the file, the line (row) and the column, at load time; the dataset's cascade overrides apply."""

import gzip
import json
import re

import pytest

from rayapp.core.cascade import cascade, dataset_override
from rayapp.envs.datasets import DatasetError, MultiDataSource
from rayapp.envs.datasets.files import FieldMap, load_file
from rayapp.envs.registry import make_dataset
from rayapp.recipe import DatasetConfig, RecipeError, parse_recipe
from rayapp.types import SamplingParams, StoppingCriteria, TaskKey

MAPPING = FieldMap(prompt="question", label="answer", task_id="id", metadata=["level"])
ROWS = [{"id": "a", "question": "Reverse 'cat'.", "answer": "tac", "level": 1, "extra": "ignored"},
        {"id": 7, "question": [{"role": "user", "content": "Reverse 'dog'."}], "answer": ["god"], "level": 2}]


def write_jsonl(path, rows, blank_after_first=False):
    lines = [json.dumps(r) if not isinstance(r, str) else r for r in rows]
    if blank_after_first:
        lines.insert(1, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_rows_become_tasks_through_the_mapping(tmp_path):
    path = write_jsonl(tmp_path / "w.jsonl", ROWS, blank_after_first=True)
    tasks = load_file(path, "words", MAPPING, task_type="reverse")
    assert [t.task_id for t in tasks] == ["a", "7"]
    assert tasks[0].prompt == "Reverse 'cat'." and tasks[0].label == "tac"
    assert tasks[1].prompt == [{"role": "user", "content": "Reverse 'dog'."}] and tasks[1].label == ["god"]
    assert [t.metadata for t in tasks] == [{"level": 1}, {"level": 2}]  # only the mapped columns
    assert {t.config.task_type for t in tasks} == {"reverse"}
    gz = tmp_path / "w.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert load_file(gz, "words", MAPPING, task_type="reverse") == tasks


def test_default_mapping_ids_by_line_and_a_task_type_column(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p1", "label": 1, "kind": "x"},
                                              {"prompt": "p2", "label": None, "kind": "y"}])
    tasks = load_file(path, "d", FieldMap(task_type="kind"), task_type="fallback")
    assert [(t.task_id, t.config.task_type, t.label) for t in tasks] == [("d-1", "x", 1), ("d-2", "y", None)]
    no_label = load_file(path, "d", FieldMap(label=None), task_type="t")
    assert [t.label for t in no_label] == [None, None]


@pytest.mark.parametrize("lines,needle", [
    ([ROWS[0], {"id": "b", "answer": "x", "level": 1}], "line 2: $.question: missing required field"),
    ([ROWS[0], "", {"id": "b", "question": "", "answer": "x", "level": 1}], "line 3: $.question: expected"),
    ([ROWS[0], {"id": "b", "question": "q", "answer": "x"}], "line 2: $.level: missing required field"),
    ([ROWS[0], {"id": True, "question": "q", "answer": "x", "level": 1}], "line 2: $.id: expected"),
    ([ROWS[0], {"id": "b", "question": [{"role": "user"}], "answer": 1, "level": 1}], "line 2: $.question"),
    ([ROWS[0], '{"id": "b", "question":'], "line 2: malformed JSON"),
    ([ROWS[0], ROWS[0]], "line 2: $.id: duplicate value 'a' (first on line 1)"),
])
def test_a_bad_row_names_the_file_the_line_and_the_column(tmp_path, lines, needle):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DatasetError) as e:
        load_file(path, "words", MAPPING, task_type="reverse")
    assert str(e.value).startswith(f"dataset 'words' ({str(path)!r}) ")
    assert needle in str(e.value), str(e.value)


def test_several_bad_rows_are_counted_in_the_one_error(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"x": 1}, ROWS[0], {"y": 2}, {"z": 3}])
    with pytest.raises(DatasetError, match=r"line 1: .* \(and 2 more bad rows\)$"):
        load_file(path, "words", MAPPING, task_type="reverse")


@pytest.mark.parametrize("name,content,needle", [
    ("missing.jsonl", None, "cannot read: "),
    ("rows.csv", "a,b\n", "unknown format: expected a file ending in .jsonl, .jsonl.gz, .parquet"),
    ("empty.jsonl", "\n\n", "no rows"),
    ("broken.jsonl.gz", "not gzip", "cannot read: "),
])
def test_a_file_that_cannot_be_read_is_one_error_naming_it(tmp_path, name, content, needle):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DatasetError) as e:
        load_file(path, "words", FieldMap(), task_type="t")
    assert f"dataset 'words' ({str(path)!r})" in str(e.value) and needle in str(e.value), str(e.value)


def test_parquet_rows_map_like_jsonl_and_a_bad_row_names_its_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    good = [{"id": "a", "question": "Reverse 'cat'.", "answer": "tac", "level": 1},
            {"id": "b", "question": "Reverse 'dog'.", "answer": "god", "level": 2}]
    path = tmp_path / "w.parquet"
    pq.write_table(pa.Table.from_pylist(good), path)
    tasks = load_file(path, "words", MAPPING, task_type="reverse")
    assert [(t.task_id, t.prompt, t.label, t.metadata) for t in tasks] == [
        ("a", "Reverse 'cat'.", "tac", {"level": 1}), ("b", "Reverse 'dog'.", "god", {"level": 2})]
    assert tasks == load_file(write_jsonl(tmp_path / "w.jsonl", good), "words", MAPPING, task_type="reverse")
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([good[0], {**good[1], "question": ""}]), bad)
    with pytest.raises(DatasetError, match=r"^dataset 'words' \(.*bad\.parquet'\) row 2: \$\.question: "):
        load_file(bad, "words", MAPPING, task_type="reverse")
    dupes = tmp_path / "dupes.parquet"
    pq.write_table(pa.Table.from_pylist([good[0], good[0]]), dupes)
    with pytest.raises(DatasetError, match=r"row 2: \$\.id: duplicate value 'a' \(first on row 1\)"):
        load_file(dupes, "words", MAPPING, task_type="reverse")
    missing = tmp_path / "nocol.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "a", "question": "q", "answer": "x"}]), missing)
    with pytest.raises(DatasetError, match=r"row 1: \$\.level: missing required field"):
        load_file(missing, "words", MAPPING, task_type="reverse")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match="cannot read: "):
        load_file(tmp_path / "junk.parquet", "words", MAPPING, task_type="reverse")


def test_a_file_dataset_carries_its_cascade_overrides_and_task_type(tmp_path):
    path = write_jsonl(tmp_path / "w.jsonl", ROWS)
    cfg = DatasetConfig(env="arithmetic", path=str(path), fields=MAPPING, n_samples_per_prompt=3,
                        dataset_cfg={"temperature": 0.3, "max_turns": 2})
    source = MultiDataSource([make_dataset(cfg, "words")], seed=0)
    tasks = source.take(4)  # wraps into a second epoch
    assert {t.task_id for t in tasks} == {"a", "7"} and {t.config.n_samples for t in tasks} == {3}
    assert {t.config.task_type for t in tasks} == {"arithmetic"}  # the env's name when nothing says otherwise
    for t in tasks:
        assert t.metadata[TaskKey.DATASET_NAME.value] == "words"
        overrides = t.metadata[TaskKey.DATASET_CFG.value]
        sampling = cascade(SamplingParams(temperature=1.0), SamplingParams(temperature=0.9),
                           dataset_override(SamplingParams, overrides))
        stopping = cascade(StoppingCriteria(max_turns=5), dataset_override(StoppingCriteria, overrides))
        assert sampling.temperature == 0.3 and stopping.max_turns == 2
    routed = DatasetConfig(env="arithmetic", path=str(path), fields=MAPPING, task_type="other")
    assert {t.config.task_type for t in make_dataset(routed, "w").rows} == {"other"}


def test_a_bad_row_fails_when_the_recipe_s_datasets_load(tmp_path):
    from rayapp.recipe import build_data_source

    path = write_jsonl(tmp_path / "w.jsonl", [ROWS[0], {"id": "b", "question": 5, "answer": "x", "level": 1}])
    args = {"engines": {"student": {}}, "evaluators": [{"evaluator_id": "arithmetic"}],
            "data": {"words": {"path": str(path), "fields": {"prompt": "question", "label": "answer",
                                                              "task_id": "id", "metadata": ["level"]}}}}
    recipe = parse_recipe(args)  # the recipe is fine; the file is read where the datasets load
    with pytest.raises(DatasetError, match=r"line 2: \$\.question: expected str \| array, got 5$"):
        build_data_source(recipe)
    args["data"]["words"]["fields"]["colour"] = "x"
    with pytest.raises(RecipeError, match=r"\$\.data\.words\.fields: unknown field \"colour\" \(expected prompt"):
        parse_recipe(args)


def test_validating_a_recipe_file_reads_its_dataset_files_ahead(tmp_path):
    import yaml

    from rayapp.recipe import load_recipe

    data = write_jsonl(tmp_path / "w.jsonl", [ROWS[0], {"id": "b", "question": "q", "answer": "x"}])
    args = {"engines": {"student": {}}, "evaluators": [{"evaluator_id": "arithmetic"}],
            "eval": {"words": {"path": str(data), "fields": {"prompt": "question", "label": "answer",
                                                             "task_id": "id", "metadata": ["level"]}}},
            "data": {"a": {}}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(args))
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert str(e.value) == (f'recipe "{path}": $.eval.words.path: dataset \'words\' ({str(data)!r}) line 2: '
                            f'$.level: missing required field')
    data.write_text(json.dumps(ROWS[0]) + "\n")
    assert load_recipe(path)[1].eval["words"].path == str(data)


def test_a_relative_dataset_path_resolves_against_the_recipe_files_folder_and_an_error_names_it(tmp_path,
                                                                                                monkeypatch):
    import yaml

    from rayapp.recipe import load_recipe

    folder = tmp_path / "exp"
    folder.mkdir()
    write_jsonl(folder / "w.jsonl", [ROWS[0]])
    fields = {"prompt": "question", "label": "answer", "task_id": "id", "metadata": ["level"]}
    args = {"engines": {"student": {}}, "evaluators": [{"evaluator_id": "arithmetic"}],
            "data": {"words": {"path": "w.jsonl", "fields": fields}}, "scheduler": {"trajectory_dir": "runs/t"}}
    path = folder / "r.yaml"
    path.write_text(yaml.safe_dump(args))
    monkeypatch.chdir(tmp_path)  # not the recipe's folder
    args_out, cfg = load_recipe("exp/r.yaml")
    assert cfg.data["words"].path == args_out["data"]["words"]["path"] == str(folder / "w.jsonl")
    assert cfg.scheduler.trajectory_dir == str(folder / "runs" / "t")
    args["data"]["words"]["path"] = "missing.jsonl"
    path.write_text(yaml.safe_dump(args))
    with pytest.raises(RecipeError, match=r"\$\.data\.words\.path: dataset 'words' \('" + re.escape(str(folder))
                       + r"/missing\.jsonl'\)"):
        load_recipe("exp/r.yaml")
