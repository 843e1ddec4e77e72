"""What to put in place of a removed attention layer: a PyTorch study on the default model (issue 9, next steps).

    python benchmarks/replacement_study.py [--moves 29:0.4,28:0.2,26:0,22:0.1,14:0.1,7:0.1,6:0.1,4:0]

For one set of attention layers (layer:alpha), replaces each layer's attention in the Hugging Face model by
  1. alpha * V·O (HARP's map, alpha 0 = drop): what `layerdrop harp` / the planner without shift writes;
  2. the same plus the mean shift m_B - alpha * m_P (means over 16 calibration windows of the unmodified model):
     what `layerdrop plan` writes by default;
  3. a least-squares d x d map + bias from the layer's normalized input to its attention output (ridge 1e-2,
     fitted over 64 calibration windows, layer by layer bottom-up with the layers below already replaced). Same
     cost as a folded V·O map; not a move layerdrop makes today.
and prints search-text and held-out perplexity (the planner's windows: 8 x 256 from the end of the calibration
text, 32 x 256 of the evaluation text). PyTorch only, so it checks the ONNX numbers independently as well.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from layerdrop.api import windows_for
from layerdrop.export.default_model import default_model_folder
from layerdrop.windows import Sampling

DEFAULT_MOVES = "29:0.4,28:0.2,26:0,22:0.1,14:0.1,7:0.1,6:0.1,4:0"


def parse_moves(text: str) -> dict[int, float]:
    return {int(k): float(v) for k, v in (part.split(":") for part in text.split(","))}


class Study:
    def __init__(self, folder, threads: int) -> None:
        torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.layers = self.model.model.layers
        self.original = [layer.self_attn.forward for layer in self.layers]

        def windows(role, samples):  # the windows of the planner's README figures: from the start of each text
            text = None if role == "eval" else Path("prose")  # the prose the README's figures were measured with
            return torch.tensor(windows_for(folder, text, role=role, samples=samples, seq_len=256,
                                            sampling=Sampling(from_start=True)).ids)

        self.calib, self.search, self.held = windows("calib", 64), windows("search", 8), windows("eval", 32)

    @torch.no_grad()
    def perplexity(self, ids: torch.Tensor) -> float:
        total, count = 0.0, 0
        for start in range(0, len(ids), 8):
            batch = ids[start:start + 8]
            logits = self.model(batch).logits[:, :-1]
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                                       reduction="sum").item()
            count += batch[:, 1:].numel()
        return math.exp(total / count)

    def restore(self) -> None:
        for layer, forward in zip(self.layers, self.original):
            layer.self_attn.forward = forward

    def replace(self, index: int, matrix: torch.Tensor, bias: torch.Tensor) -> None:
        self.layers[index].self_attn.forward = lambda hidden_states, *a, **k: (hidden_states @ matrix + bias, None)

    @torch.no_grad()
    def collect(self, index: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalized input, attention output) of one layer, every token of `ids`, float64."""
        inputs, outputs = [], []

        def hook(module, args, kwargs, output):
            inputs.append(kwargs["hidden_states"].reshape(-1, kwargs["hidden_states"].shape[-1]).double())
            outputs.append(output[0].reshape(-1, output[0].shape[-1]).double())

        handle = self.layers[index].self_attn.register_forward_hook(hook, with_kwargs=True)
        for start in range(0, len(ids), 8):
            self.model.model(ids[start:start + 8])
        handle.remove()
        return torch.cat(inputs), torch.cat(outputs)

    def vo(self, index: int) -> torch.Tensor:
        """W_V (KV heads repeated to the query heads) W_O, [d, d], float64."""
        config, attention = self.model.config, self.layers[index].self_attn
        head_dim = config.hidden_size // config.num_attention_heads
        repeat = config.num_attention_heads // config.num_key_value_heads
        w_v = attention.v_proj.weight.T.double().reshape(config.hidden_size, config.num_key_value_heads, head_dim)
        w_v = w_v.repeat_interleave(repeat, dim=1).reshape(config.hidden_size, -1)
        return w_v @ attention.o_proj.weight.T.double()

    def run(self, moves: dict[int, float], kind: str) -> tuple[float, float]:
        self.restore()
        d = self.model.config.hidden_size
        if kind == "shift":
            means = {i: tuple(t.mean(0) for t in self.collect(i, self.calib[:16])) for i in moves}
        for index in sorted(moves):
            matrix = moves[index] * self.vo(index)
            bias = torch.zeros(d, dtype=torch.float64)
            if kind == "shift":
                normed_mean, output_mean = means[index]
                bias = output_mean - normed_mean @ matrix
            elif kind == "least squares":
                inputs, outputs = self.collect(index, self.calib)
                augmented = torch.cat([inputs, torch.ones(len(inputs), 1, dtype=inputs.dtype)], 1)
                gram = augmented.T @ augmented
                gram += 1e-2 * gram.diagonal().mean() * torch.eye(len(gram), dtype=gram.dtype)
                solution = torch.linalg.solve(gram, augmented.T @ outputs)
                matrix, bias = solution[:-1], solution[-1]
            self.replace(index, matrix.float(), bias.float())
        return self.perplexity(self.search), self.perplexity(self.held)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--moves", type=parse_moves, default=parse_moves(DEFAULT_MOVES),
                        help=f"layer:alpha,... (default: the planner's pick on the default model, {DEFAULT_MOVES})")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    study = Study(default_model_folder(), args.threads)
    study.restore()
    print(f"baseline: search {study.perplexity(study.search):.2f}, held-out {study.perplexity(study.held):.2f}")
    for kind in ("alpha V·O", "shift", "least squares"):
        started = time.perf_counter()
        search, held = study.run(args.moves, kind)
        print(f"{kind}: search {search:.2f}, held-out {held:.2f} ({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
