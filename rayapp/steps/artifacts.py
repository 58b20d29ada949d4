"""Eval artifacts (docs/scheduler.md, "Eval artifacts"; ``--save-eval-details``), written crash-safe.

It exists so a user can read every sample, turn placement and step summary of a run after the fact,
while the run is still writing them: under ``{root}/eval_details/`` each step ``id`` gets
``{id}.jsonl``, ``{id}.placement.jsonl``, ``{id}.summary.json`` (``train_{id}.summary.json`` for a
rollout step). Invariant: a file never holds half a line (streamed JSONL is cut back to its last
whole line on failure, whole files are written atomically, the summary last), so a summary's
presence means the step's details are complete. Imports no torch. The fields of each file:
docs/observability.md, "Eval details files".
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from rayapp.core.contracts import EvalResult, RolloutResult
from rayapp.core.step_metrics import abort_digest, failure_summary
from rayapp.core.termination import classify_termination
from rayapp.steps.atomic_files import atomic_write
from rayapp.steps.timeline import write_timeline
from rayapp.types import Sample, StepKind, Task, TaskKey

log = logging.getLogger(__name__)

_encoder = msgspec.json.Encoder(enc_hook=lambda o: o.tolist() if hasattr(o, "tolist") else repr(o))


def _line(record: dict) -> bytes:
    """One JSONL record. JSON escapes newlines inside strings, so the only b"\\n" is the last."""
    return _encoder.encode(record) + b"\n"


def _open_append(path: Path) -> Any:
    return open(path, "ab", buffering=0)  # unbuffered: each record is one write of its own


def _cut_torn_tail(path: Path) -> int:
    """Truncate ``path`` after its last newline (a record a killed writer left half-written);
    return the resulting size."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    if size == 0:
        return 0
    with open(path, "rb") as f:
        end = size
        while end > 0:  # scan back in blocks: the torn tail is at most one record long
            start = max(0, end - 65536)
            f.seek(start)
            block = f.read(end - start)
            if end == size and block.endswith(b"\n"):
                return size
            cut = block.rfind(b"\n")
            if cut >= 0:
                end = start + cut + 1
                break
            end = start
    log.warning("%s: cutting a torn last record (%d bytes) left by an interrupted writer", path, size - end)
    os.truncate(path, end)
    return end


class JsonlAppender:
    """Appends records to a JSONL file so that it only ever holds whole lines (module docstring)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._size = _cut_torn_tail(self.path)
        self._f = _open_append(self.path)

    def append(self, record: dict) -> None:
        line, start = _line(record), self._size
        try:
            view = memoryview(line)
            while view:  # a raw write may take only part of the buffer
                view = view[self._f.write(view):]
            self._f.flush()
        except BaseException:
            try:
                os.truncate(self.path, start)  # back to the last whole line, then let the error through
            except OSError:
                log.exception("%s: could not cut a partly written record", self.path)
            raise
        self._size = start + len(line)

    def close(self) -> None:
        if self._f.closed:
            return
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
        finally:  # a failed fsync still closes the file
            self._f.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSONL file. A last line without its newline is a torn record: ignored with
    a warning. A bad line before it is damage, not a crash: ValueError naming the line."""
    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    if lines[-1]:
        log.warning("%s: ignoring a torn last record (%d bytes)", path, len(lines[-1]))
    out = []
    for n, raw in enumerate(lines[:-1], 1):
        try:
            out.append(msgspec.json.decode(raw))
        except msgspec.DecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON record ({e})") from None
    return out


# ---- records ------------------------------------------------------------------------------------

def dataset_of(sample: Sample, default: str = "unknown") -> str:
    m = sample.metadata
    return m.get(TaskKey.EVAL_DATASET_NAME) or m.get(TaskKey.DATASET_NAME) or default


def sample_record(dataset: str, s: Sample, tokens: bool = False) -> dict:
    """The ``{id}.jsonl`` line of one sample; with ``tokens``, its token data too."""
    episode = s.episode
    reason, abort = episode.reason, episode.abort
    token_data = {"tokens": s.tokens, "loss_mask": s.loss_mask, "rollout_log_probs": s.rollout_log_probs}
    return {
        "dataset": dataset, "task_id": s.task_id, "index": s.index, "status": str(s.status),
        "reward": s.reward, "termination_reason": reason,
        "failure_class": classify_termination(s.reward, reason).value,
        "turns": episode.turns or 0,
        "prompt_tokens": max(len(s.tokens) - s.response_length, 0), "response_tokens": s.response_length,
        "remove_sample": s.remove_sample,
        "abort": None if abort is None else {k: v for k, v in msgspec.to_builtins(abort).items() if k != "reason"},
        "response": s.response,
    } | (token_data if tokens else {})


def placement_records(dataset: str, s: Sample) -> list[dict]:
    """The ``{id}.placement.jsonl`` lines of one sample, one per recorded turn."""
    token = msgspec.to_builtins(s.episode.placement) if s.episode.placement is not None else {}
    out = []
    for i, turn in enumerate(msgspec.to_builtins(s.episode.turn_records), 1):
        rec = {"dataset": dataset, "task_id": s.task_id, "index": s.index, "turn": turn.get("turn", i),
               "node": turn.get("node", token.get("node")), "gpu_ids": turn.get("gpu_ids", token.get("gpu_ids")),
               "engine": turn.get("engine")}
        out.append(rec | {k: v for k, v in turn.items() if k not in rec})
    return out


def _per_dataset(by_name: dict[str, list[Sample]]) -> dict:
    return {name: {"n_samples": len(ss), "failure_classes": failure_summary(ss)} for name, ss in by_name.items()}


def eval_summary(rollout_id: int, result: EvalResult) -> dict:
    every = [s for ss in result.samples.values() for s in ss]
    return {"rollout_id": rollout_id, "kind": StepKind.EVAL.value, "n_samples": len(every),
            "failure_classes": failure_summary(every), "datasets": _per_dataset(result.samples),
            "aborts": abort_digest(every), "metrics": dict(result.metrics)}


def rollout_summary(rollout_id: int, result: RolloutResult, filters: dict | None = None) -> dict:
    """The summary of ``result``, the step before its filters; ``filters`` is their report's summary."""
    every = [s for g in result.groups for s in g]
    by_name: dict[str, list[Sample]] = defaultdict(list)
    for s in every:
        by_name[dataset_of(s)].append(s)
    return {"rollout_id": rollout_id, "kind": "train", "n_groups": len(result.groups), "n_samples": len(every),
            "n_removed": sum(s.remove_sample for s in every), "failure_classes": failure_summary(every),
            "datasets": _per_dataset(dict(by_name)), "aborts": abort_digest(every), "filters": filters,
            "metrics": dict(result.metrics)}


def _write_lines(records: Iterable[dict]) -> Callable[[BinaryIO], None]:
    def write(f: BinaryIO) -> None:
        for r in records:
            f.write(_line(r))
    return write


def _json(obj: dict) -> Callable[[BinaryIO], Any]:
    return lambda f: f.write(msgspec.json.format(_encoder.encode(obj), indent=2) + b"\n")


# ---- the writer ---------------------------------------------------------------------------------

class EvalDetailsWriter:
    """Writes the ``eval_details/`` artifacts under ``root`` (module docstring for the formats).

    Streaming and whole writes combine: ``append_sample`` (or the ``on_task_done`` callback) grows
    ``{id}.jsonl`` and ``{id}.placement.jsonl`` as samples finish, a live view for a long eval; then
    ``write_eval`` replaces both atomically with the complete files, in dataset order, and writes
    the summary. A crashed eval thus leaves whole lines of what finished, and no summary."""

    def __init__(self, root: str | os.PathLike, tokens: bool = False):
        self.dir, self.tokens = Path(root) / "eval_details", tokens
        self._streams: dict[int, tuple[JsonlAppender, JsonlAppender]] = {}

    def paths(self, rollout_id: int) -> dict[str, Path]:
        if type(rollout_id) is not int or rollout_id < 0:
            raise ValueError(f"rollout_id must be an int >= 0, got {rollout_id!r}")
        return {"samples": self.dir / f"{rollout_id}.jsonl",
                "placement": self.dir / f"{rollout_id}.placement.jsonl",
                "summary": self.dir / f"{rollout_id}.summary.json"}

    def append_sample(self, rollout_id: int, sample: Sample, dataset: str | None = None) -> None:
        """Stream one finished sample (its line and its turns' placement lines), flushed now."""
        if rollout_id not in self._streams:
            p = self.paths(rollout_id)
            self._streams[rollout_id] = (JsonlAppender(p["samples"]), JsonlAppender(p["placement"]))
        samples, placement = self._streams[rollout_id]
        name = dataset or dataset_of(sample)
        samples.append(sample_record(name, sample, self.tokens))
        for rec in placement_records(name, sample):
            placement.append(rec)

    def on_task_done(self, rollout_id: int) -> Callable[[Task, list[Sample]], Awaitable[None]]:
        """A ``TaskScheduler(on_task_done=...)`` callback that streams each finished group."""
        async def done(task: Task, samples: list[Sample]) -> None:
            for s in samples:
                name = task.metadata.get(TaskKey.EVAL_DATASET_NAME, "unknown")
                self.append_sample(rollout_id, s, dataset_of(s, name))
        return done

    def start_eval(self, rollout_id: int) -> None:
        """Begin a run of eval ``rollout_id`` afresh: any stream of an earlier run is closed and its
        files removed (a retry after a failed eval rewrites them rather than append duplicates), and
        so is its summary, whose presence would say the details are complete."""
        self.close_stream(rollout_id)
        for path in self.paths(rollout_id).values():
            path.unlink(missing_ok=True)

    @property
    def open_streams(self) -> list[int]:
        """The ids whose streamed files are open for appending."""
        return sorted(self._streams)

    def close_stream(self, rollout_id: int) -> None:
        """Close ``rollout_id``'s streamed files (both, even when the first fails; then that error)."""
        samples, placement = self._streams.pop(rollout_id, (None, None))
        try:
            if samples is not None:
                samples.close()
        finally:
            if placement is not None:
                placement.close()

    def write_eval(self, rollout_id: int, result: EvalResult) -> dict[str, Path]:
        """Write iteration ``rollout_id``'s three files whole, replacing any streamed ones."""
        p = self.paths(rollout_id)
        self.close_stream(rollout_id)
        named = [(name, s) for name, ss in result.samples.items() for s in ss]
        atomic_write(p["samples"], _write_lines(sample_record(n, s, self.tokens) for n, s in named),
                     what="eval details")
        atomic_write(p["placement"], _write_lines(r for n, s in named for r in placement_records(n, s)),
                     what="eval placement")
        atomic_write(p["summary"], _json(eval_summary(rollout_id, result)), what="eval summary")
        return p

    def write_rollout_summary(self, rollout_id: int, result: RolloutResult, filters: dict | None = None) -> Path:
        """Write ``train_{id}.summary.json`` for a rollout step: ``result`` is the step before its
        filters, ``filters`` their report's summary (``FilterReport.summary``)."""
        self.paths(rollout_id)  # validates the id
        return atomic_write(self.dir / f"train_{rollout_id}.summary.json",
                            _json(rollout_summary(rollout_id, result, filters)), what="train summary")

    def write_timeline(self, kind: str, rollout_id: int, samples: list[Sample]) -> dict[str, Path]:
        """The step's placement timeline (``steps.timeline``): ``timeline/{kind}_{id}.trace.json``
        beside ``eval_details/``, and its PNG when matplotlib is there."""
        self.paths(rollout_id)  # validates the id
        return write_timeline(samples, self.dir.parent / "timeline", f"{kind}_{rollout_id}")

    def close(self) -> None:
        """Flush, fsync and close every open stream."""
        for rid in list(self._streams):
            self.close_stream(rid)

    def __enter__(self) -> EvalDetailsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
