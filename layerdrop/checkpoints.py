"""A checkpoint store: finished results of a long job kept in a work folder on disk, each under a key derived from
everything that determines it, so a rerun loads what is done and computes only the rest.

Each entry is one file written atomically (a temporary file in the same folder, then `os.replace`): a job killed at
any moment leaves whole entries or none. A changed input changes the key (`key`), so it finds no entry and computes
afresh; entries of other inputs are left alone. The store also serves to keep large state on disk instead of in
memory: `save` and `load` take any picklable value.

Entries are Python pickles: a store must only be read by the user who wrote it (it lives beside their own output).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import numpy as np

from layerdrop.errors import LayerdropError, OutputError

SUFFIX = ".pkl"


def work_area(out_dir: Path, job: str) -> Path:
    """The work folder of `job` writing `out_dir`: a hidden sibling, `.NAME.JOB-work`, that stays where it is
    between runs (the output itself is staged elsewhere and renamed into place)."""
    out_dir = Path(out_dir)
    return out_dir.parent / f".{out_dir.name}.{job}-work"


def canonical(value):
    """`value` as JSON-ready data that determines it: arrays by dtype, shape and the SHA-256 of their bytes,
    dataclasses by class name and fields, mappings with sorted keys, sets sorted; anything else by `repr`."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value)
        return ["array", str(data.dtype), list(data.shape), hashlib.sha256(data.tobytes()).hexdigest()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [type(value).__name__, {f.name: canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}]
    if isinstance(value, dict):
        return sorted([json.dumps(canonical(k), sort_keys=True), canonical(v)] for k, v in value.items())
    if isinstance(value, (set, frozenset)):
        return sorted(json.dumps(canonical(v), sort_keys=True) for v in value)
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return repr(value)


def key(*parts) -> str:
    """A short hex digest of `parts` (`canonical`): equal for equal inputs, different when any part differs."""
    text = json.dumps(canonical(parts), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def file_digest(path: Path) -> str:
    """SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(2**20):
            digest.update(block)
    return digest.hexdigest()


class CheckpointStore:
    """Entries in `folder` (created on the first `save`), named `NAME-KEY.pkl`; `loaded` and `computed` record, in
    order, the entries this run read back and those it wrote."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.loaded: list[str] = []
        self.computed: list[str] = []

    @classmethod
    def open(cls, folder: Path, *, resume: bool, force: bool) -> CheckpointStore:
        """The store in `folder`: its entries kept with `resume`, cleared with `force`.

        Raises:
            LayerdropError: `folder` holds entries of an earlier run and neither `resume` nor `force` is given, or
                is not a folder.
        """
        folder = Path(folder)
        if folder.exists() and not folder.is_dir():
            raise LayerdropError(f"{folder} is in the way of the work folder and is not one; remove it")
        if folder.is_dir() and not resume:
            if not force:
                raise LayerdropError(f"{folder} holds the work of an interrupted run; pass --resume to continue it or "
                                     "--force to start over")
            shutil.rmtree(folder)
        return cls(folder)

    def names(self) -> list[str]:
        """The entries on disk (`NAME-KEY`), sorted."""
        if not self.folder.is_dir():
            return []
        return sorted(p.name[:-len(SUFFIX)] for p in self.folder.glob(f"*{SUFFIX}") if not p.name.startswith("."))

    def load(self, name: str, entry_key: str):
        """The value saved as `name` under `entry_key`, or None where there is none (or it cannot be read back,
        which is then recomputed); recorded in `loaded`."""
        path = self.folder / f"{name}-{entry_key}{SUFFIX}"
        try:
            with open(path, "rb") as handle:
                value = pickle.load(handle)
        except Exception:  # noqa: BLE001 - a missing or damaged entry is computed afresh
            return None
        self.loaded.append(path.name[:-len(SUFFIX)])
        return value

    def save(self, name: str, entry_key: str, value) -> None:
        """Write `value` as `name` under `entry_key`, atomically; recorded in `computed`.

        Raises:
            OutputError: the work folder cannot be written (disk full, permissions).
        """
        target = self.folder / f"{name}-{entry_key}{SUFFIX}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.folder, prefix=f".{target.name}.")
            try:
                with os.fdopen(handle, "wb") as stream:
                    pickle.dump(value, stream, protocol=pickle.HIGHEST_PROTOCOL)
                    stream.flush()
                    os.fsync(stream.fileno())
                os.replace(temporary, target)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise OutputError(f"cannot write the checkpoint {target}: {exc.strerror or exc}") from None
        self.computed.append(target.name[:-len(SUFFIX)])

    def cached(self, name: str, entry_key: str, compute):
        """The value of `name` under `entry_key`: loaded where saved, else `compute()`d and saved."""
        found = self.load(name, entry_key)
        if found is not None:
            return found[0]
        value = compute()
        self.save(name, entry_key, (value,))
        return value

    def remove(self) -> None:
        """Delete the work folder and every entry in it."""
        shutil.rmtree(self.folder, ignore_errors=True)
