"""rayapp.envs.datasets.rows: JSONL rows through the door, one DatasetError naming dataset, line and field."""

import gzip
from typing import Annotated

import msgspec
import pytest

from rayapp.envs.datasets import DatasetError, load_jsonl

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class Row(msgspec.Struct):
    """A user problem as a loader would declare it; extra fields are allowed and ignored."""

    id: NonEmpty | int
    question: NonEmpty
    answer: NonEmpty | int | float


def test_rows_load_plain_and_gzipped_skipping_blank_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"id": 1, "question": "What is 2+2?", "answer": 4, "source": "x"}\n\n'
                    '{"id": "b", "question": "Half of 5?", "answer": "2.50"}\n')
    expected = [Row(1, "What is 2+2?", 4), Row("b", "Half of 5?", "2.50")]
    assert load_jsonl(path, "mine", Row, unique="id") == expected
    gz = tmp_path / "m.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert load_jsonl(gz, "mine", Row, unique="id") == expected


@pytest.mark.parametrize("lines,needle", [
    (['{"id": 1, "question": "q", "answer": 1}', '{"id": 2, "answer": 3}'],
     "dataset 'bad' ({path!r}) line 2: $.question: missing required field"),
    (['{"id": 1, "question": "q", "answer": [1]}'], "line 1: $.answer: expected"),
    (['{"id": 1, "question": "", "answer": 1}'], "line 1: $.question: expected str of length >= 1"),
    (['{"id": 1, "question": "q", "answer": 1}', "", '{"id": 1,'], "line 3: malformed JSON: "),
    (['[1, 2]'], "line 1: $: expected object, got an array of 2 items"),
    (['{"id": true, "question": "q", "answer": 1}'], "line 1: $.id: expected int | str, got true"),
    (['{"id": 7, "question": "q", "answer": 1}', '{"id": "7", "question": "r", "answer": 2}'],
     "line 2: $.id: duplicate value '7' (first on line 1)"),
    (['{"id": 1}', '{"id": 2}', '{"id": 3}'], "line 1: $.question: missing required field (and 2 more bad rows)"),
    ([""], "no rows"),
])
def test_bad_rows_raise_one_error_naming_dataset_line_and_field(tmp_path, lines, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError) as e:
        load_jsonl(path, "bad", Row, unique="id")
    assert needle.format(path=str(path)) in str(e.value)
    assert isinstance(e.value, ValueError)


def test_missing_file_is_a_dataset_error(tmp_path):
    with pytest.raises(DatasetError, match=r"dataset 'gone'.*cannot read"):
        load_jsonl(tmp_path / "nope.jsonl", "gone", Row)
