"""A plan's checkpoints (`layerdrop.checkpoints`): every finished measurement (the scores, the sizing of a speedup
budget's rows, each phase of candidates with its searches and fits, each measured row with its accuracy items and
timings) is saved in the work folder beside `-o` as it is made, keyed by the model folder, the windows it read and
every option that shapes it, so `plan --resume` computes only what a killed run had not finished.

Timings pool runs by structure across a plan (`search.selection.PrefillMeter`): an entry that times also keeps the
meter's runs so far, and its key follows the meter's previous entry, so a resumed run times on from the same
runs."""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

from layerdrop.checkpoints import CheckpointStore, file_digest, key, work_area
from layerdrop.errors import LayerdropError
from layerdrop.windows import Windows

JOB = "plan"


def plan_work_area(out_dir: Path) -> Path:
    """Where a plan writing `out_dir` keeps its checkpoints until it succeeds: `.NAME.plan-work` beside it."""
    return work_area(out_dir, JOB)


def folder_fingerprint(folder: Path, onnx_path: Path) -> str:
    """What identifies a model folder's content: the graph file's SHA-256 and every other file's name, size and
    modification time (the weights' external data can be many GB; a rewritten one changes its time)."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(folder).iterdir()
                   if p.is_file() and p != Path(onnx_path))
    return key(file_digest(onnx_path), files)


def window_ids(windows: Windows | None):
    """The part of `windows` a measurement depends on: its token ids and whether they start with a BOS."""
    return None if windows is None else (windows.ids, windows.bos)


class Checkpoints:
    """The plan's checkpoints in `store`, each keyed by its name, the model folder's `fingerprint` and the parts
    given; `chains` holds, per prefill meter, the key of the last entry that timed with it."""

    def __init__(self, store: CheckpointStore, fingerprint: str) -> None:
        self.store, self.fingerprint = store, fingerprint
        self.chains: dict[int, str | None] = {}

    def cached(self, name: str, parts: tuple, compute, *, skipped: list[str] | None = None, meter=None):
        """`compute()`, or its saved value where a finished run of the same inputs saved it; the notes it appended
        to `skipped` and (with a `meter`) the meter's timed runs are saved and restored with it."""
        if meter is not None:
            parts = (*parts, self.chains.get(id(meter)))
        entry = key(name, self.fingerprint, parts)
        found = self.store.load(name, entry)
        if found is not None:
            value, notes, state = found
            if skipped is not None:
                skipped.extend(notes)
            if meter is not None:
                meter.measured, meter.keys, meter.timings = copy.deepcopy(state)
        else:
            before = len(skipped) if skipped is not None else 0
            value = compute()
            notes = list(skipped[before:]) if skipped is not None else []
            state = (meter.measured, meter.keys, meter.timings) if meter is not None else None
            self.store.save(name, entry, (value, notes, state))
        if meter is not None:
            self.chains[id(meter)] = entry
        return value

    def summary(self) -> str | None:
        """A note for the user on a resumed run: how many measurements were loaded and how many computed."""
        if not self.store.loaded:
            return None
        return (f"resumed from {self.store.folder}: {len(self.store.loaded)} finished measurements loaded, "
                f"{len(self.store.computed)} computed")


def keeps_work(plan):
    """`plan` with its work folder kept for `--resume` where it stops part way (Ctrl-C: a KeyboardInterrupt whose
    message says how to resume) and removed where bad input stops a run that made it (nothing is left beside the
    output)."""

    @functools.wraps(plan)
    def wrapper(model_path, out_dir, *args, **kwargs):
        folder = plan_work_area(out_dir)
        existed = os.path.lexists(folder)
        try:
            return plan(model_path, out_dir, *args, **kwargs)
        except KeyboardInterrupt:
            if CheckpointStore(folder).names():
                raise KeyboardInterrupt(f"finished measurements are kept in {folder}; rerun the same command with "
                                        "--resume to continue from them") from None
            raise
        except LayerdropError:
            if not existed:
                CheckpointStore(folder).remove()
            raise

    return wrapper
