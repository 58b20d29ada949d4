"""The spec's reuse policy (§5 "Reuse & resume") as a decision per iteration, from its STACX_*
knobs: roll out fresh and save, or load a saved trajectory file (``trajectories.py``)."""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayapp.types import Sample

log = logging.getLogger(__name__)

MAIN_FILE = "trajectory_sft_samples.pt"
PER_ITER_FILE = "trajectory_sft_samples_iter_{:03d}.pt"
_PER_ITER_RE = re.compile(r"^trajectory_sft_samples_iter_(\d+)\.pt$")

# ---- policy --------------------------------------------------------------------------------

ENV_KNOBS: dict[str, tuple[str, str]] = {  # name -> (default, meaning); read by rayapp.recipe.environment
    "STACX_FORCE_FRESH_ROLLOUT": ("0", "1: roll out fresh every iteration (live DAgger/AggreVaTe/OPD), "
                                       f"bypassing reuse; each saves {MAIN_FILE}"),
    "STACX_REUSE_ROLLOUT": ("0", f"1: every iteration loads {MAIN_FILE} instead of rolling out (iter-SFT)"),
    "STACX_REUSE_PER_ITER_DIR": ("", "folder of trajectory_sft_samples_iter_NNN.pt: iteration k replays the "
                                     "k-th by NNN; past the last is an error"),
    "STACX_SAVE_PER_ITER_PT": ("1", "0: fresh iterations skip the per-iteration trajectory_sft_samples_iter_NNN.pt"),
}


class SaveKind(enum.StrEnum):
    """Which file a fresh iteration saves; the value names it among a step's artifacts."""

    MAIN = "trajectory"  # MAIN_FILE, overwritten by every fresh iteration
    PER_ITER = "trajectory_iter"  # PER_ITER_FILE, this iteration's own


@dataclass(frozen=True)
class Decision:
    """What one iteration does: roll out (``fresh``) or load ``load_path``; then save ``save_paths``."""

    fresh: bool
    load_path: Path | None
    save_paths: dict[SaveKind, Path]
    mode: str = ""  # "force-fresh" | "first" | "reuse" | "auto-reuse" | "replay", for logs


def per_iter_files(folder: str | os.PathLike) -> list[Path]:
    """The ``trajectory_sft_samples_iter_NNN.pt`` files of ``folder``, by NNN (temp files ignored)."""
    found: dict[int, Path] = {}
    for p in Path(folder).iterdir():
        if m := _PER_ITER_RE.match(p.name):
            n = int(m.group(1))
            if n in found:
                raise ValueError(f"{folder}: {found[n].name} and {p.name} are both iteration {n}")
            found[n] = p
    return [found[n] for n in sorted(found)]


@dataclass(frozen=True)
class ReusePolicy:
    """The spec's reuse policy as a decision per iteration (main = ``save_dir/trajectory_sft_samples.pt``,
    iter_NNN = ``save_dir/trajectory_sft_samples_iter_NNN.pt``, saved only while SAVE_PER_ITER_PT is on):

    FORCE_FRESH=1, whatever else is set       fresh; save main + iter_NNN          mode "force-fresh"
    REUSE_ROLLOUT=1                           load main                            mode "reuse"
    REUSE_PER_ITER_DIR=d, iteration k         load the k-th iter file of d by NNN  mode "replay"
    REUSE_ROLLOUT=1 and REUSE_PER_ITER_DIR    ValueError (ambiguous)
    neither, rollout_id == 0                  fresh; save main + iter_000          mode "first"
    neither, rollout_id > 0                   load main (iteration 0's data)       mode "auto-reuse"

    ``decide`` is a pure function of the policy and its arguments, except that replay lists d."""

    force_fresh: bool = False
    reuse_rollout: bool = False
    reuse_per_iter_dir: Path | None = None
    save_per_iter_pt: bool = True

    def __post_init__(self) -> None:
        if self.reuse_rollout and self.reuse_per_iter_dir is not None and not self.force_fresh:
            raise ValueError("STACX_REUSE_ROLLOUT=1 and STACX_REUSE_PER_ITER_DIR are both set: "
                             "choose one source of reused trajectories")
        if self.force_fresh and (self.reuse_rollout or self.reuse_per_iter_dir is not None):
            log.warning("STACX_FORCE_FRESH_ROLLOUT=1 bypasses STACX_REUSE_ROLLOUT / STACX_REUSE_PER_ITER_DIR")

    def decide(self, rollout_id: int, save_dir: str | os.PathLike) -> Decision:
        if type(rollout_id) is not int or rollout_id < 0:
            raise ValueError(f"rollout_id must be an int >= 0, got {rollout_id!r}")
        main = Path(save_dir) / MAIN_FILE
        saves = {SaveKind.MAIN: main}
        if self.save_per_iter_pt:
            saves[SaveKind.PER_ITER] = Path(save_dir) / PER_ITER_FILE.format(rollout_id)
        if self.force_fresh:
            return Decision(True, None, saves, "force-fresh")
        if self.reuse_rollout:
            return Decision(False, main, {}, "reuse")
        if self.reuse_per_iter_dir is not None:
            folder = self.reuse_per_iter_dir
            if not folder.is_dir():
                raise ValueError(f"STACX_REUSE_PER_ITER_DIR={str(folder)!r} is not a folder")
            files = per_iter_files(folder)
            # Past the end is an error, not a wrap: silently re-training on early iterations would
            # change the recipe; the run should be asked for no more iterations than were dumped.
            if rollout_id >= len(files):
                raise ValueError(f"STACX_REUSE_PER_ITER_DIR={str(folder)!r} holds {len(files)} per-iteration "
                                 f"files; iteration {rollout_id} has none to replay")
            return Decision(False, files[rollout_id], {}, "replay")
        if rollout_id == 0:
            return Decision(True, None, saves, "first")
        return Decision(False, main, {}, "auto-reuse")  # multi-epoch SFT on iteration 0's data



async def rollout_or_reuse(rollout_id: int, save_dir: str | os.PathLike, run: Any,
                           policy: ReusePolicy | None = None) -> tuple[list[list[Sample]], Decision]:
    """One iteration under the reuse policy: the saved groups, or ``await run()``'s groups saved
    where the policy says. File work runs in a thread, off the event loop."""
    # Trajectory files are torch.save files: torch (the hf or sglang extra) is needed only once one is read or written.
    from rayapp.steps.trajectories import load_trajectories, save_trajectories

    decision = (policy or ReusePolicy()).decide(rollout_id, save_dir)
    if not decision.fresh:
        _, groups = await asyncio.to_thread(load_trajectories, decision.load_path)
        return groups, decision
    groups = await run()
    for path in decision.save_paths.values():
        await asyncio.to_thread(save_trajectories, path, groups, rollout_id)
    return groups, decision
