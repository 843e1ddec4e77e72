"""Measuring a candidate: its perplexity on the search and held-out windows, its accuracy on the held-out items,
its KV cache and its prefill speedup, as one `PlanRow`.

The rows share the baseline's work where they can: the baseline keeps the hidden state entering a few attention
layers from its own runs (`Prefix`), and a row whose lowest changed layer is at or above one of them runs from
there (`passes.graph_cuts.suffix_to_logits`), since every layer below it computes what the baseline's does."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir

from layerdrop.api.plan.candidates import Candidate
from layerdrop.api.plan.report import PlanRow
from layerdrop.api.plan.texts import HeldOut, Validation
from layerdrop.api.reports import text_labels
from layerdrop.formats import TOKEN_LOGPROBS
from layerdrop.passes.find_residuals import annotated_regions
from layerdrop.passes.graph_cuts import HIDDEN_INPUT, suffix_to_logits, with_outputs
from layerdrop.passes.logits_from import with_logits_from
from layerdrop.passes.token_logprobs import TokenLogprobsPass, with_token_logprobs
from layerdrop.runtime.evaluate import perplexity
from layerdrop.runtime.session import RunOptions
from layerdrop.search.measure import attention_entries
from layerdrop.search.selection import PrefillMeter
from layerdrop.windows import Windows

PREFIX_BYTES = 512 * 2**20  # the baseline's hidden states kept for the measured rows' suffixes, at most
FIDELITY_BYTES = 256 * 2**20  # the baseline's next-token log-probabilities kept to measure the rows' fidelity, at most


def fidelity_windows(held: Windows, vocabulary: int) -> Windows:
    """The held-out windows the rows' fidelity is measured on: as many of the first whole windows as
    `FIDELITY_BYTES` of the baseline's float32 log-probabilities hold, else the first window's first tokens."""
    tokens = max(2, FIDELITY_BYTES // (4 * max(vocabulary, 1)))
    count, length = held.ids.shape
    kept, length = (min(count, tokens // length), length) if tokens >= length else (1, tokens)
    source = {**held.source, "starts": held.source.get("starts", [])[:kept], "samples": kept, "seq_len": length}
    return Windows(held.ids[:kept, :length], source, held.bos)


@dataclass
class Prefix:
    """The baseline's hidden state entering some attention layers, for every measured window set (search,
    held-out, other held-out texts), filled by the baseline row's own runs."""

    entries: dict[int, str]  # kept layer -> the name of the value entering its attention
    states: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # layer -> window set -> [n, seq, d]

    def start(self, rewritten: ir.Model, candidate: Candidate) -> int | None:
        """The highest kept layer at or below the candidate's lowest changed layer whose entry the `rewritten`
        graph still has, or None (run the whole model)."""
        lowest = candidate.lowest_changed()
        if lowest is None or not self.states:
            return None
        names = {v.name for node in rewritten.graph for v in node.outputs}
        return max((k for k in self.states if k <= lowest and self.entries[k] in names), default=None)


def choose_prefix(model: ir.Model, candidates: list[Candidate], windows: int, seq: int) -> Prefix:
    """Which layers' entering states to keep for the rows: chosen greedily by the layer runs they save (a row runs
    from the highest kept layer at or below its lowest changed one), as many as `PREFIX_BYTES` holds for
    `windows` windows of `seq` tokens."""
    entries = attention_entries(model)
    values = {v.name: v for node in model.graph for v in node.outputs}
    shapes = [values[name].shape for name in entries.values() if name in values and values[name].shape]
    width = shapes[0][-1] if shapes and isinstance(shapes[0][-1], int) else None
    lowest = [k for k in (c.lowest_changed() for c in candidates) if k]
    if width is None or not lowest:
        return Prefix({})

    def saved(layers: list[int]) -> int:
        return sum(max((k for k in layers if k <= low), default=0) for low in lowest)

    kept: list[int] = []
    for _ in range(PREFIX_BYTES // (windows * seq * width * 4)):
        best = max(sorted(set(lowest) - set(kept)), key=lambda k: saved([*kept, k]), default=None)
        if best is None or saved([*kept, best]) == saved(kept):
            break
        kept.append(best)
    return Prefix({k: entries[k] for k in kept if k in entries})


@dataclass
class Measure:
    """How every row is measured: the annotated model and its folder, the search windows and what is held out, the
    number of attention layers (for the share that keeps a KV cache), how ONNX Runtime runs, and (where the rows
    are timed) the meter and the runs of each row's timing."""

    model: ir.Model
    folder: Path
    search: Windows
    held_out: HeldOut
    layers: int
    options: RunOptions
    meter: PrefillMeter | None = None
    runs: int = 0
    prefix: Prefix | None = None
    validation: Validation | None = None
    fidelity: Windows | None = None  # held-out windows the rows' fidelity to the baseline is measured on
    reference: np.ndarray | None = None  # the baseline's next-token log-probabilities on them (its row sets it)

    def sets(self) -> dict[str, Windows]:
        """Every set of windows a row's perplexity is measured on, by key: search, eval, also0, ..., val0, ..."""
        kinds = self.validation.kinds.values() if self.validation is not None else ()
        return {**self.held_out.sets(self.search), **{f"val{i}": w for i, w in enumerate(kinds)}}

    def row(self, candidate: Candidate, timed: bool = True) -> PlanRow:
        """The candidate's row: its rewritten model's perplexity on the search and the held-out windows, its
        accuracy on the held-out items, the share of attention layers that keep a KV cache, and (with a meter and
        `timed`) its prefill speedup against the baseline's, runs alternating, pooled with the runs of any graph of
        the same structure timed before (`search.selection.PrefillMeter.timed`).

        Perplexities come from a session whose graph takes the log-softmax itself (`with_token_logprobs`);
        fidelity and accuracies from one whose LM head runs only at the positions an answer needs
        (`passes.logits_from`); timings from the graph as it is written (a session the meter builds, if it needs
        runs of the row's structure, after the row's own is freed). With a `prefix`, the baseline (a candidate
        without moves) keeps the hidden states it names from its own runs, and a row whose lowest changed layer is
        at or above a kept one runs from there."""
        rewritten = candidate.applied_to(self.model)
        run = candidate.run
        sets = self.sets()
        ppl = self.perplexities(rewritten, candidate, sets)
        row = PlanRow(
            method=candidate.name, alphas={int(k): v for k, v in sorted(candidate.alphas.items())},
            fits=sorted(candidate.fits or {}), shift=candidate.means is not None,
            ridges={int(k): v for k, v in (candidate.ridges or {}).items()},
            blocks=candidate.blocks or (list(range(run.start + 1, run.start + 1 + run.count)) if run else []),
            replaced_into=run.start if run else None, run_ridge=run.ridge if run else None,
            moves=sorted(candidate.moves), paper=candidate.paper,
            kv_kept=sum(r.kind == "attn" for r in annotated_regions(rewritten)) / self.layers,
            search_ppl=ppl["search"], eval_ppl=ppl["eval"])
        if self.held_out.others:
            also = [key for key in sets if key.startswith("also")]
            labels = text_labels([sets[key].source for key in also])  # texts that share a file name stay apart
            row.also_eval_ppl = {label: ppl[key] for label, key in zip(labels, also)}
        if self.validation is not None and self.validation.kinds:
            row.validation_ppl = {kind: ppl[f"val{i}"] for i, kind in enumerate(self.validation.kinds)}
        timed = timed and self.meter is not None and self.runs > 0
        items = self.validation.items if self.validation is not None else 0
        fidelity = self.fidelity is not None
        session = None
        if self.held_out.items is not None or items or self.held_out.tasks or fidelity:
            session = self.options.session(with_logits_from(rewritten), folder=self.folder)
        if fidelity:
            self.measure_fidelity(row, candidate, session)
        if self.held_out.items is not None:
            scores = self.accuracy(rewritten, session)
            row.accuracy, row.accuracy_correct = scores.accuracy, [int(c) for c in scores.correct]
        if items:
            correct = self.validation_tasks(rewritten, session, items)
            row.validation_accuracy = float(np.mean([c for outcomes in correct.values() for c in outcomes]))
            row.validation_correct = correct
        if self.held_out.tasks:
            row.tasks_correct, row.tasks_chance = self.standard_tasks(rewritten, session)
        if timed:
            del session  # freed before the meter builds one of the graph as written
            row.speedup, row.speedup_runs, row.structure = self.meter.timed(rewritten, self.runs)
        return row

    def perplexities(self, rewritten: ir.Model, candidate: Candidate, sets: dict[str, Windows]) -> dict[str, float]:
        """The rewritten model's perplexity on each window set, from its lowest changed layer where the prefix keeps
        the baseline's state there (the baseline fills the prefix from these runs); the session is freed on
        return."""
        prefix, batch = self.prefix, self.options.batch_size
        start = prefix.start(rewritten, candidate) if prefix is not None else None
        if start is not None:
            graph = suffix_to_logits(rewritten, prefix.entries[start])
            TokenLogprobsPass()(graph)
            scoring = self.options.session(graph, folder=self.folder)
            return {key: perplexity(scoring, w.ids, batch_size=batch,
                                    feed_extra=lambda rows, key=key: {HIDDEN_INPUT: prefix.states[start][key][rows]}
                                    ).perplexity for key, w in sets.items()}
        keep = prefix is not None and candidate.lowest_changed() is None and bool(prefix.entries)
        graph = with_token_logprobs(rewritten)
        if keep:  # the baseline: its runs also return the states the rows will start from
            graph = with_outputs(graph, [TOKEN_LOGPROBS, *prefix.entries.values()])
        scoring = self.options.session(graph, folder=self.folder)
        found = {}
        for key, w in sets.items():
            capture = {name: [] for name in prefix.entries.values()} if keep else None
            found[key] = perplexity(scoring, w.ids, batch_size=batch, capture=capture).perplexity
            for layer, name in (prefix.entries.items() if keep else ()):
                prefix.states.setdefault(layer, {})[key] = np.concatenate(capture[name])
        return found

    def accuracy(self, rewritten: ir.Model, session):
        """lm-eval's accuracy on the held-out items and each item's outcome (`runtime.tasks.ChoiceScores`), through
        the `layerdrop` lm-eval model on the row's own session."""
        from layerdrop.runtime.tasks import choice_scores

        return choice_scores(self.lm(rewritten, session), self.held_out.items)

    def validation_tasks(self, rewritten: ir.Model, session, items: int) -> dict[str, list[int]]:
        """Each validation task's items' outcomes (1 right, 0 wrong; `items` of each task in VALIDATION_TASKS, in
        split order), by task, through lm-eval's own task definitions and the `layerdrop` lm-eval model on the
        row's own session."""
        from layerdrop.runtime.standard_tasks import VALIDATION_TASKS, run_standard_tasks

        outcomes = run_standard_tasks(self.lm(rewritten, session), list(VALIDATION_TASKS), limit=items,
                                      tasks=VALIDATION_TASKS)
        return {name: [int(c) for c in outcomes[name].correct] for name in VALIDATION_TASKS}

    def measure_fidelity(self, row: PlanRow, candidate: Candidate, session) -> None:
        """The row's KL divergence from the baseline's next-token distribution and their top-1 agreement on the
        fidelity windows; the baseline (a candidate without moves, measured first) keeps its log-probabilities as
        the reference."""
        from layerdrop.runtime.fidelity import fidelity_to, log_probs

        batch = self.options.batch_size
        if not candidate.moves and self.reference is None:
            self.reference = log_probs(session, self.fidelity.ids, batch_size=batch)
        found = fidelity_to(self.reference, session, self.fidelity.ids, batch_size=batch)
        row.kl, row.top1_agreement = found.kl, found.top1

    def standard_tasks(self, rewritten: ir.Model, session) -> tuple[dict[str, list[float]], dict[str, float]]:
        """Each of the papers' tasks' items (the first `held_out.tasks` of each reported split) as the row did on
        them (the value of the task's metric) and each task's mean chance level, through lm-eval's own task
        definitions and the `layerdrop` lm-eval model on the row's own session."""
        from layerdrop.runtime.standard_tasks import PAPERS, run_standard_tasks

        outcomes = run_standard_tasks(self.lm(rewritten, session), PAPERS, limit=self.held_out.tasks)
        return ({name: [float(c) for c in o.correct] for name, o in outcomes.items()},
                {name: float(o.chance.mean()) for name, o in outcomes.items()})

    def lm(self, rewritten: ir.Model, session):
        """The `layerdrop` lm-eval model of the rewritten graph on the row's own session."""
        from layerdrop.runtime.harness import LayerdropLM

        return LayerdropLM(path=str(self.folder), model=rewritten, session=session,
                           batch_size=max(8, self.options.batch_size), progress=False)
