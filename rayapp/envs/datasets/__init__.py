"""Datasets and data sources: MultiDataSource, validated row loading, dataset files (JSONL, Parquet)
with a field mapping, and the mini-SWE repositories as package data. The environments themselves
are one module each, in ``rayapp.envs``. See each module's docstring for the guarantees it keeps."""

from rayapp.envs.datasets.rows import DatasetError, decode_rows, load_jsonl
from rayapp.envs.datasets.source import DatasetSpec, MultiDataSource, eval_tasks, stamp

__all__ = ["DatasetError", "DatasetSpec", "MultiDataSource", "decode_rows", "eval_tasks", "load_jsonl", "stamp"]
