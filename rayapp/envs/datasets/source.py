"""MultiDataSource: weighted draws over several datasets, resumable exactly (docs/scheduler.md §2).

Guarantees:

- Construction loads every dataset once and validates everything it was given: unique non-empty
  names, at least one row each, every row a ``Task``, finite weights >= 0 with a positive total,
  ``n_samples_per_prompt`` >= 1, and each dataset's ``_dataset_cfg`` through the cascade's own
  ``dataset_override`` for StoppingCriteria and SamplingParams, so a bad override fails here, naming
  the dataset, not mid-rollout.
- ``take(n)`` (awaited: ``get_tasks(n)``) picks each task's dataset by weight with one seeded
  ``random.Random`` and takes the next row of that dataset's order. A dataset's order in epoch ``e``
  is a function of (seed, name, e) alone: a fresh permutation per epoch when ``shuffle`` is on, row
  order otherwise; after its last row the dataset wraps into the next epoch. Draws split any way
  give the same stream: ``take(a) + take(b) == take(a + b)``.
- Every task handed out is a fresh copy carrying ``metadata["_dataset_name"]`` and its own copy of
  ``metadata["_dataset_cfg"]`` (the cascade's third level) plus ``_dataset_epoch``; the loaded rows
  are never mutated, so a consumer editing a task changes nothing here.
- ``state_dict()`` is plain JSON-able data (seed, RNG state as lists, per-dataset epoch and cursor);
  ``load_state_dict(state)`` makes the stream continue exactly where the saved one would have, also
  after a JSON round-trip. A bad state raises one InputError naming the field and changes nothing.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args

import msgspec
from msgspec import Meta

from rayapp.core.cascade import dataset_override
from rayapp.core.convert import InputError, convert
from rayapp.types import SamplingParams, StoppingCriteria, Task, TaskKey

_Version = Literal[1]
STATE_VERSION: int = get_args(_Version)[0]
_MT_WORDS = 624  # Mersenne Twister state words; getstate() adds the position as a 625th


@dataclass
class DatasetSpec:
    """One dataset of a MultiDataSource. ``rows`` is the list of tasks or a zero-argument callable
    that loads them (called once, at construction). ``n_samples_per_prompt`` sets each task's group
    size; None keeps the row's own ``config.n_samples``. ``dataset_cfg`` is flat: keys naming a
    StoppingCriteria or SamplingParams field take part in the cascade; others are the source's."""

    name: str
    rows: Sequence[Task] | Callable[[], Sequence[Task]]
    weight: float = 1.0
    dataset_cfg: dict[str, Any] = field(default_factory=dict)
    n_samples_per_prompt: int | None = None
    shuffle: bool = True


def stamp(task: Task, spec: DatasetSpec, epoch: int | None = None) -> Task:
    """A copy of ``task`` as this dataset hands it out: its group size and the cascade's metadata.
    Deep-copied so that nothing a consumer does to it reaches the loaded rows or the spec."""
    out = copy.deepcopy(task)
    if spec.n_samples_per_prompt is not None:
        out.config.n_samples = spec.n_samples_per_prompt
    out.metadata = {**out.metadata, TaskKey.DATASET_NAME.value: spec.name,
                    TaskKey.DATASET_CFG.value: copy.deepcopy(spec.dataset_cfg)}
    if epoch is not None:
        out.metadata[TaskKey.DATASET_EPOCH.value] = epoch
    return out


def eval_tasks(spec: DatasetSpec, n: int | None = None) -> list[Task]:
    """The first ``n`` rows (all when None) in row order, stamped: a fixed eval set for one dataset,
    as ``TaskScheduler(eval_datasets={name: ...})`` takes it."""
    rows = _load(spec)
    return [stamp(t, spec) for t in rows[: len(rows) if n is None else n]]


def _load(spec: DatasetSpec) -> list[Task]:
    rows = list(spec.rows() if callable(spec.rows) else spec.rows)
    if not rows:
        raise ValueError(f"dataset {spec.name!r}: no rows")
    for i, row in enumerate(rows):
        if not isinstance(row, Task):
            raise ValueError(f"dataset {spec.name!r}: row {i} is a {type(row).__name__}, not a Task")
    return rows


def _check_spec(spec: DatasetSpec) -> None:
    where = f"dataset {spec.name!r}"
    if not isinstance(spec.name, str) or not spec.name:
        raise ValueError(f"dataset name must be a non-empty string, got {spec.name!r}")
    if isinstance(spec.weight, bool) or not isinstance(spec.weight, int | float) or not (
            math.isfinite(spec.weight) and spec.weight >= 0):
        raise ValueError(f"{where}: weight must be a finite number >= 0, got {spec.weight!r}")
    n = spec.n_samples_per_prompt
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"{where}: n_samples_per_prompt must be an int >= 1, got {n!r}")
    if not isinstance(spec.dataset_cfg, dict):
        raise ValueError(f"{where}: dataset_cfg must be a mapping, got {type(spec.dataset_cfg).__name__}")
    # The same check the scheduler runs per sample: failing here names the dataset before any rollout.
    dataset_override(StoppingCriteria, spec.dataset_cfg, where)
    dataset_override(SamplingParams, spec.dataset_cfg, where)


_Word = Annotated[int, Meta(ge=0, le=2**32 - 1)]
_SOURCE = "data source state"


class _DatasetState(msgspec.Struct, forbid_unknown_fields=True):
    epoch: Annotated[int, Meta(ge=0)]
    cursor: Annotated[int, Meta(ge=0)]
    size: int


class _State(msgspec.Struct, forbid_unknown_fields=True):
    version: _Version
    seed: int
    # CPython's Random state since 3.2: version 3, the Mersenne Twister words + the position, gauss_next.
    rng: tuple[Literal[3], Annotated[list[_Word], Meta(min_length=_MT_WORDS + 1, max_length=_MT_WORDS + 1)],
               float | None]
    datasets: dict[str, Any]  # converted per name below: msgspec would name a bad key only as [...]

    def __post_init__(self) -> None:
        if self.rng[1][-1] > _MT_WORDS:
            raise ValueError(f"$.rng[1][{_MT_WORDS}]: expected a position <= {_MT_WORDS}, got {self.rng[1][-1]}")


class MultiDataSource:
    """Several datasets drawn by weight; see the module docstring for the guarantees."""

    def __init__(self, datasets: Sequence[DatasetSpec], seed: int = 0):
        if not datasets:
            raise ValueError("MultiDataSource needs at least one dataset")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        names = [d.name for d in datasets]
        for d in datasets:
            _check_spec(d)
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"dataset names must be unique; repeated: {dupes}")
        if sum(d.weight for d in datasets) <= 0:
            raise ValueError("at least one dataset needs a weight > 0")
        self.specs = list(datasets)
        self.seed = seed
        self._rows = [_load(d) for d in self.specs]
        self._weights = [float(d.weight) for d in self.specs]
        self._rng = random.Random(seed)
        self._epoch = [0] * len(self.specs)
        self._cursor = [0] * len(self.specs)
        self._orders: list[list[int] | None] = [None] * len(self.specs)  # cache of the current epoch's order

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.specs]

    def sizes(self) -> dict[str, int]:
        return {d.name: len(rows) for d, rows in zip(self.specs, self._rows, strict=True)}

    def _order(self, i: int) -> list[int]:
        order = self._orders[i]
        if order is None:
            order = list(range(len(self._rows[i])))
            if self.specs[i].shuffle:
                # Seeded by (seed, name, epoch) rather than drawn from the weight RNG: the order can
                # then be rebuilt from a saved epoch number, and adding a dataset leaves others' orders alone.
                random.Random(f"{self.seed}:{self.specs[i].name}:{self._epoch[i]}").shuffle(order)
            self._orders[i] = order
        return order

    def _next(self, i: int) -> Task:
        if self._cursor[i] >= len(self._rows[i]):  # wrap lazily, so a saved cursor may equal the size
            self._epoch[i] += 1
            self._cursor[i] = 0
            self._orders[i] = None
        row = self._rows[i][self._order(i)[self._cursor[i]]]
        self._cursor[i] += 1
        return stamp(row, self.specs[i], self._epoch[i])

    async def get_tasks(self, n: int) -> list[Task]:  # the scheduler's DataSource protocol
        return self.take(n)

    def take(self, n: int) -> list[Task]:
        """The next ``n`` tasks of the stream."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"take: n must be an int >= 0, got {n!r}")
        # One random() per task whatever the split, which is what makes split draws equal whole ones.
        picks = self._rng.choices(range(len(self.specs)), weights=self._weights, k=n)
        return [self._next(i) for i in picks]

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss_next = self._rng.getstate()
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "rng": [version, list(internal), gauss_next],
            "datasets": {
                d.name: {"epoch": self._epoch[i], "cursor": self._cursor[i], "size": len(self._rows[i])}
                for i, d in enumerate(self.specs)
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream a ``state_dict()`` saved. The state's seed wins over the constructor's:
        the per-epoch orders derive from it, so adopting it is what makes the restore exact."""
        st = convert(state, _State, _SOURCE)
        if set(st.datasets) != set(self.names):
            missing, extra = sorted(set(self.names) - set(st.datasets)), sorted(set(st.datasets) - set(self.names))
            raise InputError(_SOURCE, "$.datasets", f"names do not match this source (missing {missing}, "
                                                    f"unknown {extra})")
        per_name = {name: convert(ds, _DatasetState, _SOURCE, root=f"$.datasets.{name}")
                    for name, ds in st.datasets.items()}
        for name, size in self.sizes().items():
            ds = per_name[name]
            if ds.size != size:
                raise InputError(_SOURCE, f"$.datasets.{name}.size",
                                 f"saved with {ds.size} rows, this source has {size}")
            if ds.cursor > ds.size:
                raise InputError(_SOURCE, f"$.datasets.{name}.cursor", f"must be in 0..{ds.size}, got {ds.cursor}")
        # Everything checked: only now change anything.
        rng = random.Random()
        rng.setstate((st.rng[0], tuple(st.rng[1]), st.rng[2]))
        self._rng, self.seed = rng, st.seed
        for i, name in enumerate(self.names):
            self._epoch[i], self._cursor[i] = per_name[name].epoch, per_name[name].cursor
            self._orders[i] = None
