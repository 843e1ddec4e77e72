"""Study: do fitted attention maps that read more previous tokens ([x_t, x_{t-1}, ..., x_{t-k}]) bring held-out
perplexity closer to the baseline than the previous-token maps (k = 1)? An independent PyTorch implementation: the
Hugging Face model with the chosen layers' attention outputs replaced by ridge maps of the attention's normalized
input and its k previous positions (zeros before a window's start), fitted bottom-up in float64 normal equations on
calibration windows, each layer's ridge chosen among (1e-3, 1e-2, 1e-1) by its squared error on the search windows.

    python benchmarks/lag_study.py --layers 3,5,6,7,14,27,28,29 --lags 1,2 [--fit-samples 64]

Windows as `layerdrop plan` draws them (bundled mix for fits and search, 32 held-out windows of 256 tokens of each
bundled kind, seed 0).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from layerdrop.export.default_model import known_model_folder
from layerdrop.windows import draw_windows, resolve_text

RIDGES = (1e-3, 1e-2, 1e-1)


class Stop(Exception):
    pass


def lagged(x: torch.Tensor, lags: int) -> torch.Tensor:
    """[b, s, d] -> [b, s, d * (lags + 1)]: x_t, x_{t-1}, ..., zeros before the window's start."""
    parts = [x]
    for k in range(1, lags + 1):
        parts.append(torch.nn.functional.pad(x, (0, 0, k, 0))[:, :-k])
    return torch.cat(parts, dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", default="smollm2-135m")
    parser.add_argument("--layers", required=True)
    parser.add_argument("--lags", default="1,2")
    parser.add_argument("--fit-samples", type=int, default=64)
    parser.add_argument("--eval-samples", type=int, default=32)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    folder = known_model_folder(args.source)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    calib_sha = draw_windows(folder, resolve_text("calib"), role="calib", samples=1, seq_len=256).source["sha256"]
    fit = draw_windows(folder, resolve_text("calib"), role="calib", samples=args.fit_samples, seq_len=256)
    search = draw_windows(folder, resolve_text("calib"), role="search", samples=16, seq_len=256,
                          calibration_sha256=calib_sha)
    held = {kind: draw_windows(folder, resolve_text(kind, "eval"), role="eval", samples=args.eval_samples,
                               seq_len=256, calibration_sha256=calib_sha) for kind in ("eval", "docs", "code",
                                                                                       "dictionary")}
    layers = sorted(int(x) for x in args.layers.split(","))
    attn = {i: model.model.layers[i].self_attn for i in layers}
    maps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    lags_now = {"k": 1}

    def replace(i):
        def hook(module, inputs, kwargs, output):
            if i not in maps:
                return output
            x = kwargs.get("hidden_states", inputs[0] if inputs else None)
            w, b = maps[i]
            return (lagged(x, lags_now["k"]) @ w + b, *output[1:])
        return hook

    for i in layers:
        attn[i].register_forward_hook(replace(i), with_kwargs=True)

    def stats(ids: np.ndarray, layer: int, k: int):
        captured = {}

        def grab(module, inputs, kwargs, output):
            captured["x"] = kwargs.get("hidden_states", inputs[0] if inputs else None)
            captured["y"] = output[0]
            raise Stop

        handle = attn[layer].register_forward_hook(grab, with_kwargs=True, prepend=True)
        d = model.config.hidden_size
        gram = np.zeros((d * (k + 1) + 1,) * 2)
        cross = np.zeros((d * (k + 1) + 1, d))
        square = 0.0
        with torch.no_grad():
            for start in range(0, len(ids), 8):
                try:
                    model(torch.from_numpy(ids[start:start + 8]))
                except Stop:
                    pass
                a = lagged(captured["x"], k).reshape(-1, d * (k + 1)).double().numpy()
                a = np.concatenate([a, np.ones((len(a), 1))], axis=1)
                y = captured["y"].reshape(-1, d).double().numpy()
                gram += a.T @ a
                cross += a.T @ y
                square += float((y * y).sum())
        handle.remove()
        return gram, cross, square

    def perplexity(ids: np.ndarray) -> float:
        total, count = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(ids), 8):
                batch = torch.from_numpy(ids[start:start + 8])
                logits = model(batch).logits[:, :-1].float()
                nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                        batch[:, 1:].reshape(-1), reduction="sum")
                total += float(nll)
                count += batch[:, 1:].numel()
        return float(np.exp(total / count))

    results = {"baseline": {kind: perplexity(w.ids) for kind, w in held.items()}}
    print("baseline", {k: round(v, 2) for k, v in results["baseline"].items()}, flush=True)
    for k in (int(x) for x in args.lags.split(",")):
        began = time.time()
        lags_now["k"] = k
        maps.clear()
        chosen = {}
        for layer in layers:  # bottom-up: the layers below already replaced
            gram, cross, _ = stats(fit.ids, layer, k)
            vgram, vcross, vsquare = stats(search.ids, layer, k)
            best = None
            for ridge in RIDGES:
                penalty = ridge * float(np.mean(np.diag(gram))) * np.eye(len(gram))
                theta = np.linalg.solve(gram + penalty, cross)
                error = float(np.sum(theta * (vgram @ theta)) - 2 * np.sum(theta * vcross) + vsquare)
                if best is None or error < best[0]:
                    best = (error, ridge, theta)
            _, chosen[layer], theta = best
            maps[layer] = (torch.from_numpy(theta[:-1]).float(), torch.from_numpy(theta[-1]).float())
        ppl = {kind: perplexity(w.ids) for kind, w in held.items()}
        results[f"lags={k}"] = {**ppl, "ridges": chosen, "seconds": time.time() - began}
        print(f"lags={k}", {kind: f"{v:.2f} ({v / results['baseline'][kind]:.3f}x)" for kind, v in ppl.items()},
              chosen, f"{time.time() - began:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
