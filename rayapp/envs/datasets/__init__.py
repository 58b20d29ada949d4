"""Datasets and data sources: MultiDataSource, validated row loading, and the built-in
math and HumanEval environments. See each module's docstring for the guarantees it keeps."""

from rayapp.envs.datasets.rows import DatasetError, decode_rows, load_jsonl
from rayapp.envs.datasets.source import DatasetSpec, MultiDataSource, eval_tasks, stamp

__all__ = ["DatasetError", "DatasetSpec", "MultiDataSource", "decode_rows", "eval_tasks", "load_jsonl", "stamp"]
