"""The config cascade for generation settings (docs/scheduler.md §2).

Stopping criteria and sampling params resolve field by field through three levels, the most
specific set value winning: the global setting, then the spec's default, then the per-dataset
override carried in ``sample.metadata["_dataset_cfg"]`` (set by the data source). ``None`` at a
level means "not set here". A dataset's config is a flat mapping; only the keys that name a field
of StoppingCriteria or SamplingParams (``CASCADE_FIELDS``) take part. A recipe allows no other key
(``rayapp.recipe`` refuses a misspelt one); rows built in code may carry more for their data source.
Values go through the one door (``rayapp.core.convert``): a bad one is a ``CascadeError`` naming
the dataset and the field (``dataset 'gsm8k': $.dataset_cfg.max_turns: expected int >= 1, got 0``).
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from rayapp.core.convert import InputError, convert, show
from rayapp.types import Sample, SamplingParams, StoppingCriteria, TaskKey

S = TypeVar("S", StoppingCriteria, SamplingParams)
# The keys a dataset's config may set, the fields of the two cascaded types.
CASCADE_FIELDS: tuple[str, ...] = (*StoppingCriteria.__struct_fields__, *SamplingParams.__struct_fields__)


class CascadeError(InputError):
    """A per-dataset setting that does not fit its field, or a cascade with nothing to overlay."""


def cascade(*levels: S | None) -> S:
    """Overlay ``levels`` left to right: each set (non-None) field replaces the one below."""
    present = [lvl for lvl in levels if lvl is not None]
    if not present:
        raise CascadeError("cascade", None, "needs at least one level")
    merged: dict[str, Any] = {}
    for level in present:
        merged.update({k: v for k, v in msgspec.structs.asdict(level).items() if v is not None})
    return type(present[0])(**merged)


def dataset_override(cls: type[S], dataset_cfg: Any, where: str = "dataset") -> S | None:
    """The fields of ``cls`` that a dataset's config sets, through the door (``where``: $.dataset_cfg.field:
    reason); None when it sets none."""
    if not dataset_cfg:
        return None
    if not isinstance(dataset_cfg, dict):
        raise CascadeError(where, "$.dataset_cfg", f"expected an object of settings, got {show(dataset_cfg)}")
    names = cls.__struct_fields__
    picked = {k: v for k, v in dataset_cfg.items() if k in names}
    return convert(picked, cls, where, root="$.dataset_cfg", error=CascadeError) if picked else None


def _where(sample: Sample) -> str:
    name = sample.metadata.get(TaskKey.EVAL_DATASET_NAME) or sample.metadata.get(TaskKey.DATASET_NAME)
    return f"dataset {name!r}" if name else f"task {sample.task_id!r}"


def resolve_stopping(
    global_: StoppingCriteria, spec_default: StoppingCriteria, sample: Sample
) -> StoppingCriteria:
    cfg = sample.metadata.get(TaskKey.DATASET_CFG)
    return cascade(global_, spec_default, dataset_override(StoppingCriteria, cfg, _where(sample)))


def build_sampling_params(
    global_: SamplingParams, spec_default: SamplingParams, sample: Sample
) -> SamplingParams:
    cfg = sample.metadata.get(TaskKey.DATASET_CFG)
    return cascade(global_, spec_default, dataset_override(SamplingParams, cfg, _where(sample)))
