"""lm-evaluation-harness model `layerdrop`: a layerdrop model folder run by ONNX Runtime.

`lm_eval --model layerdrop --model_args path=OUTDIR,provider=cpu --tasks ...` finds this class through the startup
hook in `layerdrop/_lm_eval_hook.py`; `layerdrop eval MODEL --tasks ...` uses it directly. Needs the `eval` extra.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from layerdrop import model_folder
from layerdrop.errors import LayerdropError

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError:  # pragma: no cover - exercised only without the extra
    raise LayerdropError("lm-eval is not installed; install the eval extra: pip install -e '.[eval]'") from None
from tqdm import tqdm

from layerdrop.formats import LOGITS_FROM, is_carried
from layerdrop.runtime.evaluate import token_logprobs
from layerdrop.runtime.feeds import is_kv_graph, prefill_feed, takes_padded_batches
from layerdrop.runtime.generate import cached_feed, greedy_batch, left_pad, right_pad
from layerdrop.runtime.session import make_session
from layerdrop.windows import load_tokenizer

DEFAULT_MAX_LENGTH = 2048
DEFAULT_BATCH = 8


def _batch_size(value) -> int:
    if value in (None, "auto") or str(value).startswith("auto"):
        return DEFAULT_BATCH
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise LayerdropError(f"batch_size must be a positive integer or 'auto', not {value!r}") from None
    if size < 1:
        raise LayerdropError(f"batch_size must be a positive integer or 'auto', not {value!r}")
    return size


class LayerdropLM(TemplateLM):
    """A layerdrop model folder (model.onnx, its weights, tokenizer.json, config.json) as an lm-eval model.

    Log-likelihoods come from right-padded batches (every row keeps positions 0, 1, ..., so any causal graph scores
    it as if alone, GroupQueryAttention included). On a graph with a KV cache that takes padded batches, requests
    that share a context (the choices of a multiple-choice question) run that context once: its cache is computed
    for all of them and each continuation runs after it, which for four short choices is less than half the tokens.
    Generation is greedy, uses the KV cache when the graph has one,
    and runs left-padded batches, or one prompt at a time on a graph that takes no padded batch
    (`feeds.takes_padded_batches`).
    """

    def __init__(
        self,
        path: str | None = None,
        pretrained: str | None = None,
        provider: str | None = None,
        device: str | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | str | None = None,
        threads: int | None = None,
        progress: bool = True,
        model=None,
        session=None,
        **_ignored,
    ) -> None:
        """`model`: an in-memory rewrite (an ir.Model) of the folder's graph to run instead of the folder's own
        model.onnx, and `session`, if given, an ONNX Runtime session already built from it; the folder still gives
        the tokenizer, the config and the weights' files."""
        super().__init__()
        path = path or pretrained
        if not path:
            raise LayerdropError("give the model folder: --model_args path=OUTDIR")
        if model is None:  # one read of the graph: checked (external data, with clear errors), run as written
            self.folder, model = model_folder.load(Path(path))
        else:
            self.folder = model_folder.resolve(Path(path))
        if provider is None:
            provider = "cuda" if device and str(device).startswith("cuda") else "cpu"
        self.session = session or make_session(model, folder=self.folder.path, provider=provider,
                                               threads=int(threads) if threads else None)
        self._padded_batches = takes_padded_batches(model)
        # a graph with `passes.logits_from`'s input computes the LM head only where an answer needs it
        self._logits_from = LOGITS_FROM in {i.name for i in self.session.get_overridable_initializers()}
        self._shares_contexts = self._padded_batches and is_kv_graph(self.session)
        self.tokenizer = load_tokenizer(self.folder.path)
        config = model_folder.config(self.folder.path)
        eos = config.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if not isinstance(eos, int):
            raise LayerdropError(f"{self.folder.path}/config.json has no eos_token_id; add it")
        self._eot = eos
        self._pad = config.get("pad_token_id") if isinstance(config.get("pad_token_id"), int) else eos
        self._max_length = int(max_length or config.get("max_position_embeddings") or DEFAULT_MAX_LENGTH)
        self._max_gen_toks = int(max_gen_toks)
        self._batch = _batch_size(batch_size)
        # None: the tokenizer's own convention, as lm-eval's `hf` model does (a BOS for Gemma, none for SmolLM2)
        self.add_bos_token = None if add_bos_token in (None, "", "None") else str(add_bos_token).lower() in (
            "1", "true", "yes")
        self.progress = str(progress).lower() not in ("0", "false", "no")

    # -- what TemplateLM asks for ----------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context is conditioned on: the tokenizer's BOS if it has one, else EOS (as `hf`)."""
        bos = self.tokenizer.declared_bos_id
        return bos if bos is not None else self._eot

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_kwargs) -> list[int]:
        """Token ids as lm-eval's `hf` model makes them: the tokenizer's BOS convention unless `add_bos_token` or
        `add_special_tokens` says otherwise, and no second BOS when the string already starts with it."""
        ids = self.tokenizer.encode(string)
        special = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        bos = self.tokenizer.bos_id if special is None else (self.tokenizer.declared_bos_id if special else None)
        if add_special_tokens is None and bos is not None and ids[:1] == [bos]:
            return ids  # the text already starts with the BOS
        return [bos, *ids] if bos is not None else ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def _logits(self, sequences: list[list[int]], needed: list[int]) -> list[np.ndarray]:
        """Each sequence's logits at its last `needed` positions [needed, vocab], from one right-padded batch."""
        ids, mask = right_pad(sequences, self._pad)
        firsts = [max(len(s) - n, 0) for s, n in zip(sequences, needed)]
        start = min(firsts) if self._logits_from else 0
        logits = self.session.run(["logits"], prefill_feed(self.session, ids, mask, extra=self._from(start)))[0]
        return [logits[row, first - start:len(s) - start] for row, (s, first) in enumerate(zip(sequences, firsts))]

    def _from(self, position: int) -> dict[str, np.ndarray]:
        """The feed that starts the logits at `position`, where the graph takes it (else every position's)."""
        return {LOGITS_FROM: np.array([position], dtype=np.int64)} if self._logits_from else {}

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, batch: int | None = None,
                              **_kwargs) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation) per request."""
        disable_tqdm = disable_tqdm or not self.progress
        batch = batch or self._batch
        inputs = []
        for _key, context, continuation in requests:
            if not continuation:
                raise LayerdropError("a request has an empty continuation; the task's answer text is empty")
            if len(continuation) > self._max_length:
                raise LayerdropError(f"an answer is {len(continuation)} tokens, longer than max_length "
                                     f"{self._max_length}; raise max_length")
            whole = (context + continuation)[-(self._max_length + 1):]
            inputs.append(whole[:-1])
        shared = self._shared_contexts(requests, inputs)
        alone = sorted(set(range(len(requests))) - {i for group in shared for i in group},
                       key=lambda i: -len(inputs[i]))  # similar lengths share a batch
        answers: list[tuple[float, bool] | None] = [None] * len(requests)

        def answer(index: int, logits: np.ndarray) -> None:
            key, _context, continuation = requests[index]
            chosen = logits[-len(continuation):]
            picked = token_logprobs(chosen, np.asarray(continuation))
            answers[index] = (float(picked.sum()), bool((chosen.argmax(axis=-1) == continuation).all()))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answers[index])

        with tqdm(total=len(requests), desc="layerdrop loglikelihood", disable=disable_tqdm) as bar:
            # as many contexts a run as keep its continuations within four batches' rows
            per_run = max(1, 4 * batch // max((len(g) for g in shared), default=1))
            for start in range(0, len(shared), per_run):
                groups = shared[start:start + per_run]
                for index, logits in self._after_contexts(groups, requests):
                    answer(index, logits)
                bar.update(sum(len(g) for g in groups))
            for start in range(0, len(alone), batch):
                chunk = alone[start:start + batch]
                needed = [len(requests[i][2]) for i in chunk]
                for index, logits in zip(chunk, self._logits([inputs[i] for i in chunk], needed)):
                    answer(index, logits)
                bar.update(len(chunk))
        return answers  # type: ignore[return-value]

    def _shared_contexts(self, requests, inputs: list[list[int]]) -> list[list[int]]:
        """Groups of request indices with one context of at least two tokens, run whole (not cut to max_length),
        ordered so that contexts of one length are neighbours; none where the graph cannot run them so."""
        if not self._shares_contexts:
            return []
        groups: dict[tuple, list[int]] = {}
        for index, (_key, context, continuation) in enumerate(requests):
            if len(context) >= 2 and len(inputs[index]) == len(context) + len(continuation) - 1:
                groups.setdefault(tuple(context), []).append(index)
        return sorted((g for g in groups.values() if len(g) > 1), key=lambda g: len(requests[g[0]][1]))

    def _after_contexts(self, groups: list[list[int]], requests) -> list[tuple[int, np.ndarray]]:
        """(request index, logits [its continuation's length, vocab]) for every request of `groups`: the contexts
        but their last token run once (one batch per context length) into the cache, then each request's last
        context token and continuation but its last token after its own context's cache, right-padded."""
        found = []
        by_length: dict[int, list[list[int]]] = {}
        for group in groups:
            by_length.setdefault(len(requests[group[0]][1]), []).append(group)
        names = [o.name for o in self.session.get_outputs() if is_carried(o.name)]
        inputs = {i.name for i in self.session.get_inputs()}
        for length, same in by_length.items():
            prefix = np.array([requests[g[0]][1][:-1] for g in same], dtype=np.int64)
            # the contexts only fill the cache: no position of theirs needs logits
            cache = dict(zip(names, self.session.run(names, prefill_feed(self.session, prefix,
                                                                       extra=self._from(prefix.shape[1])))))
            rows = [(owner, index) for owner, group in enumerate(same) for index in group]
            tails = [[requests[i][1][-1], *requests[i][2][:-1]] for _, i in rows]
            ids, tail_mask = right_pad(tails, self._pad)
            owners = np.array([owner for owner, _ in rows])
            mask = np.concatenate([np.ones((len(rows), length - 1), dtype=np.int64), tail_mask], axis=1)
            positions = np.broadcast_to(np.arange(length - 1, length - 1 + ids.shape[1]), ids.shape)
            feed = cached_feed({n: v[owners] for n, v in cache.items()}, ids, mask, positions, inputs)
            logits = self.session.run(["logits"], feed)[0]
            found += [(index, logits[row, :len(tails[row])]) for row, (_, index) in enumerate(rows)]
        return found

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts, in windows of at most max_length tokens (lm-eval's own windowing)."""
        results = []
        disable_tqdm = disable_tqdm or not self.progress
        for (text,) in tqdm([r.args for r in requests], desc="layerdrop rolling", disable=disable_tqdm):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self._max_length,
                context_len=1)]
            # one window per run: a window may be max_length tokens, and its logits are max_length x vocab floats
            scores = self._loglikelihood_tokens([(None, c, t) for c, t in windows], disable_tqdm=True, batch=1)
            total = sum(s for s, _ in scores)
            results.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop string; batched by identical generation settings."""
        results: list[str | None] = [None] * len(requests)
        disable_tqdm = disable_tqdm or not self.progress
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(index)
        with tqdm(total=len(requests), desc="layerdrop generate", disable=disable_tqdm) as bar:
            for indices in groups.values():
                kwargs = dict(requests[indices[0]].args[1])
                until, steps = self._generation_settings(kwargs)
                for start in range(0, len(indices), self._batch):
                    chunk = indices[start:start + self._batch]
                    for index, text in zip(chunk, self._generate([requests[i].args[0] for i in chunk], until, steps)):
                        results[index] = text
                        self.cache_hook.add_partial("generate_until", requests[index].args, text)
                    bar.update(len(chunk))
        return results  # type: ignore[return-value]

    def _generation_settings(self, kwargs: dict) -> tuple[list[str], int]:
        until = kwargs.pop("until", None)
        until = [until] if isinstance(until, str) else list(until or [])
        until.append(self.tok_decode([self._eot], skip_special_tokens=False))
        steps = int(kwargs.pop("max_gen_toks", self._max_gen_toks))
        if kwargs.pop("do_sample", False) or float(kwargs.pop("temperature", 0.0) or 0.0) > 0:
            raise LayerdropError("the layerdrop lm-eval model decodes greedily; the task asks for sampling")
        return [u for u in until if u], steps

    def _generate(self, contexts: list[str], until: list[str], steps: int) -> list[str]:
        room = max(self._max_length - steps, 1)
        prompts = [self.tok_encode(c)[-room:] or [self.prefix_token_id] for c in contexts]

        def finished(_row: int, tokens: list[int]) -> bool:
            if tokens[-1] == self._eot:
                return True
            text = self.tok_decode(tokens, skip_special_tokens=False)
            return any(stop in text for stop in until)

        if self._padded_batches:
            generated = greedy_batch(self.session, *left_pad(prompts, self._pad), steps, finished=finished)[0]
        else:
            generated = [greedy_batch(self.session, np.array([p]), np.ones((1, len(p))), steps, finished=finished)[0][0]
                         for p in prompts]
        texts = []
        for tokens in generated:
            text = self.tok_decode(tokens, skip_special_tokens=False)
            for stop in until:
                text = text.split(stop)[0]
            texts.append(text)
        return texts
