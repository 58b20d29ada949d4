"""The config cascade for generation settings (spec §2).

Stopping criteria and sampling params resolve field by field through three levels, the most
specific set value winning: the global setting, then the spec's default, then the per-dataset
override carried in ``sample.metadata["_dataset_cfg"]`` (set by the data source). ``None`` at a
level means "not set here". A dataset's config is a flat mapping; only the keys that name a field
of StoppingCriteria or SamplingParams take part, the rest (weights, paths, ...) belong to the data
source. Values are validated, and a bad one names the dataset and the field.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from rayapp.types import Sample, SamplingParams, StoppingCriteria

S = TypeVar("S", StoppingCriteria, SamplingParams)


class CascadeError(ValueError):
    pass


def cascade(*levels: S | None) -> S:
    """Overlay ``levels`` left to right: each set (non-None) field replaces the one below."""
    present = [lvl for lvl in levels if lvl is not None]
    if not present:
        raise CascadeError("cascade needs at least one level")
    merged: dict[str, Any] = {}
    for level in present:
        merged.update({k: v for k, v in msgspec.structs.asdict(level).items() if v is not None})
    return type(present[0])(**merged)


def dataset_override(cls: type[S], dataset_cfg: dict[str, Any] | None, where: str = "dataset") -> S | None:
    """The fields of ``cls`` that a dataset's config sets, validated; None when it sets none."""
    if not dataset_cfg:
        return None
    if not isinstance(dataset_cfg, dict):
        raise CascadeError(f"{where}: _dataset_cfg must be a mapping, got {type(dataset_cfg).__name__}")
    names = {f.name for f in msgspec.structs.fields(cls)}
    picked = {k: v for k, v in dataset_cfg.items() if k in names}
    if not picked:
        return None
    try:
        return msgspec.convert(picked, cls)
    except msgspec.ValidationError as e:
        raise CascadeError(f"{where}: {cls.__name__}: {e}") from None


def _where(sample: Sample) -> str:
    name = sample.metadata.get("_eval_dataset_name") or sample.metadata.get("_dataset_name")
    return f"dataset {name!r}" if name else f"task {sample.task_id!r}"


def resolve_stopping(
    global_: StoppingCriteria, spec_default: StoppingCriteria, sample: Sample
) -> StoppingCriteria:
    cfg = sample.metadata.get("_dataset_cfg")
    return cascade(global_, spec_default, dataset_override(StoppingCriteria, cfg, _where(sample)))


def build_sampling_params(
    global_: SamplingParams, spec_default: SamplingParams, sample: Sample
) -> SamplingParams:
    cfg = sample.metadata.get("_dataset_cfg")
    return cascade(global_, spec_default, dataset_override(SamplingParams, cfg, _where(sample)))
