"""Independent PyTorch references: tiny models of seven families, modules replaced by identity, hook scores."""

from __future__ import annotations

import copy

import numpy as np
import torch
import transformers

VOCAB = 320

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)

FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON),
    "mistral": lambda: transformers.MistralConfig(**_COMMON, sliding_window=None),
    "gemma2": lambda: transformers.Gemma2Config(
        **{**_COMMON, "tie_word_embeddings": True}, head_dim=8, sliding_window=256, query_pre_attn_scalar=8
    ),
    "phi3": lambda: transformers.Phi3Config(**_COMMON, pad_token_id=0),
    # Gemma-3 text: q/k norms, pre- and post-norms around both branches, query scaling, and local layers with a
    # sliding window shorter than the test sequences next to a global one
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**_COMMON, "tie_word_embeddings": True}, head_dim=8, query_pre_attn_scalar=16, sliding_window=6,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]),
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=8),
}

# Head size 16, which ONNX Runtime's CPU GroupQueryAttention kernel takes (it refuses 8): the fused graphs of these
# have GroupQueryAttention; the sliding-window Gemma keeps MultiHeadAttention (the fusion would drop its window).
_WIDE = {**_COMMON, "hidden_size": 64, "intermediate_size": 128}
WIDE_HEAD_FAMILIES = {
    "llama-h16": lambda: transformers.LlamaConfig(**_WIDE),
    "qwen3-h16": lambda: transformers.Qwen3Config(**_WIDE, head_dim=16),
    "gemma3-h16": lambda: transformers.Gemma3TextConfig(
        **{**_WIDE, "tie_word_embeddings": True}, head_dim=16, query_pre_attn_scalar=16,
        layer_types=["full_attention"] * 4),
    "gemma3-h16-sliding": lambda: transformers.Gemma3TextConfig(
        **{**_WIDE, "tie_word_embeddings": True}, head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]),
}


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A random-weight model of `family`; norms get random weights too, so no two norms are alike."""
    torch.manual_seed(seed)
    config = {**FAMILIES, **WIDE_HEAD_FAMILIES}[family]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
            if name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


class _ZeroAttention(torch.nn.Module):
    def forward(self, hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states), None


class _ZeroMLP(torch.nn.Module):
    def forward(self, hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states)


class _RescaledVO(torch.nn.Module):
    """SPEC §4: attention replaced by alpha * (x W_V, heads repeated to the query heads) W_O (+ biases)."""

    def __init__(self, attention: torch.nn.Module, config, alpha: float, shift: torch.Tensor | float = 0.0) -> None:
        super().__init__()
        self.attention = attention
        self.alpha = alpha
        self.shift = shift
        text = config.get_text_config(decoder=True)
        self.heads = text.num_attention_heads
        self.kv_heads = getattr(text, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // self.heads

    def _values(self, x: torch.Tensor) -> torch.Tensor:
        attn = self.attention
        if hasattr(attn, "v_proj"):
            return attn.v_proj(x)
        qkv = attn.qkv_proj(x)  # Phi-3: packed [q | k | v]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return qkv[..., q_size + kv_size : q_size + 2 * kv_size]

    def forward(self, hidden_states, *args, **kwargs):
        v = self._values(hidden_states)
        b, t, _ = v.shape
        v = v.view(b, t, self.kv_heads, self.head_dim)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=2).reshape(b, t, self.heads * self.head_dim)
        return self.alpha * self.attention.o_proj(v) + self.shift, None


def replaced(model: torch.nn.Module, targets, alphas: dict[int, float] | None = None,
             shifts: dict[int, np.ndarray] | None = None) -> torch.nn.Module:
    """A copy of `model` with (kind, layer) modules replaced by zero branches and HARP layers by the V·O map.

    For Gemma-2 the post-attention norm stays after the V·O map and alpha scales after it (SPEC §4). `shifts`
    adds a constant vector to the branch of those HARP layers (the planner's mean shift).
    """
    model = copy.deepcopy(model)
    layers = model.model.layers
    for kind, index in targets:
        if kind in ("attn", "block"):
            layers[index].self_attn = _ZeroAttention()
        if kind in ("mlp", "block"):
            layers[index].mlp = _ZeroMLP()
    for index, alpha in (alphas or {}).items():
        layer = layers[index]
        shift = torch.tensor((shifts or {}).get(index, 0.0), dtype=next(model.parameters()).dtype)
        if hasattr(layer, "post_feedforward_layernorm"):  # Gemma-2: alpha after the post-attention norm
            layer.self_attn = _RescaledVO(layer.self_attn, model.config, 1.0)
            layer.post_attention_layernorm = _Scaled(layer.post_attention_layernorm, alpha, shift)
        else:
            layer.self_attn = _RescaledVO(layer.self_attn, model.config, alpha, shift)
    return model


class _Scaled(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, alpha: float, shift: torch.Tensor | float = 0.0) -> None:
        super().__init__()
        self.inner = inner
        self.alpha = alpha
        self.shift = shift

    def forward(self, x):
        return self.alpha * self.inner(x) + self.shift


def branch_means(model: torch.nn.Module, windows: np.ndarray, layers, skip_first: bool = False
                 ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per layer, the means over all tokens of `windows` (but position 0 with `skip_first`: a BOS) of the
    attention branch output (after a post-attention norm, if any) and of the same branch with attention replaced
    by the unscaled V·O map, both on the unmodified model's hidden states."""
    first = 1 if skip_first else 0
    sums = {layer: [0.0, 0.0] for layer in layers}
    handles = []
    for index in layers:
        layer = model.model.layers[index]
        post = layer.post_attention_layernorm if hasattr(layer, "post_feedforward_layernorm") else None
        vo = _RescaledVO(layer.self_attn, model.config, 1.0)

        def hook(module, args, kwargs, output, index=index, post=post, vo=vo):
            branch, bypass = output[0], vo(kwargs["hidden_states"])[0]
            if post is not None:
                branch, bypass = post(branch), post(bypass)
            for slot, value in enumerate((branch, bypass)):
                value = value[:, first:]
                sums[index][slot] = sums[index][slot] + value.double().reshape(-1, value.shape[-1]).sum(0)

        handles.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            for row in windows:
                model(torch.tensor(row[None]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    tokens = windows.shape[0] * (windows.shape[1] - first)
    return {layer: (pair[0].numpy() / tokens, pair[1].numpy() / tokens) for layer, pair in sums.items()}


def logits(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    with torch.no_grad():
        kwargs = {} if mask is None else {"attention_mask": torch.tensor(mask)}
        return model(torch.tensor(ids), use_cache=False, **kwargs).logits.double().numpy()


def greedy(model: torch.nn.Module, ids: np.ndarray, steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decoding by recomputing the whole sequence each step (no cache): tokens and last-position logits."""
    seq = list(ids[0])
    tokens, step_logits = [], []
    for _ in range(steps):
        last = logits(model, np.array([seq]))[0, -1]
        token = int(np.argmax(last))
        tokens.append(token)
        step_logits.append(last)
        seq.append(token)
    return tokens, step_logits


def sampled(model: torch.nn.Module, count: int, width: int, first_tokens: np.ndarray, seed: int,
            bos_id: int | None = None, batch_size: int = 16) -> np.ndarray:
    """Windows the model writes itself, by recomputing the whole sequence each step (no cache), replaying the draws
    `runtime.generate.sample_windows` documents: per batch, the first tokens from `rng.choice`, then one uniform a
    row a step, mapped through the inverse of the softmax's cumulative distribution (torch's, in float64)."""
    rng = np.random.default_rng(seed)
    windows = []
    for start in range(0, count, batch_size):
        rows = min(batch_size, count - start)
        firsts = rng.choice(np.asarray(first_tokens, dtype=np.int64), rows)
        seqs = [([] if bos_id is None else [bos_id]) + [int(first)] for first in firsts]
        while len(seqs[0]) < width:
            with torch.no_grad():
                last = model(torch.tensor(seqs), use_cache=False).logits[:, -1].double()
            cumulative = torch.cumsum(torch.softmax(last, dim=-1), dim=-1).numpy()
            uniform = rng.random(rows)
            for row in range(rows):
                seqs[row].append(int(np.searchsorted(cumulative[row], uniform[row], side="right")))
        windows.append(np.array(seqs))
    return np.concatenate(windows)


def hook_scores(model: torch.nn.Module, windows: np.ndarray, skip_first: bool = False) -> dict[tuple[str, int], float]:
    """SPEC §2 scores from forward hooks: X before each norm, Y after each residual Add, float64 cosine; with
    `skip_first`, position 0 (a BOS) is left out of the average."""
    captured: dict[tuple[str, int], list[torch.Tensor]] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        def before(name):
            def hook(module, args, kwargs=None):
                captured.setdefault(name, []).append(args[0].detach())
            return hook

        handles.append(layer.input_layernorm.register_forward_pre_hook(before(("x_attn", i))))
        mlp_norm = getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm
        handles.append(mlp_norm.register_forward_pre_hook(before(("x_mlp", i))))
        handles.append(layer.register_forward_hook(
            lambda module, args, out, i=i: captured.setdefault(("out", i), []).append(
                (out[0] if isinstance(out, tuple) else out).detach())))
    with torch.no_grad():
        for row in windows:
            model(torch.tensor(row[None]), use_cache=False)
    for handle in handles:
        handle.remove()

    def distance(x_key, y_key):
        x = torch.cat(captured[x_key]).double()[:, 1 if skip_first else 0:]
        y = torch.cat(captured[y_key]).double()[:, 1 if skip_first else 0:]
        return float((1 - torch.nn.functional.cosine_similarity(x, y, dim=-1)).mean())

    scores = {}
    for i in range(len(model.model.layers)):
        scores[("attn", i)] = distance(("x_attn", i), ("x_mlp", i))
        scores[("mlp", i)] = distance(("x_mlp", i), ("out", i))
        scores[("block", i)] = distance(("x_attn", i), ("out", i))
    return scores


def planned(model: torch.nn.Module, alphas: dict[int, float], shift_windows=None) -> torch.nn.Module:
    """The reference for a plan's moves: HARP maps (alpha 0: dropped), or, with `shift_windows` (layerdrop's
    Windows: their ids, and whether column 0 is a BOS), mean-shifted maps whose constants m_B - alpha * m_P come
    from `branch_means` over those windows."""
    if shift_windows is None:
        return replaced(model, [("attn", layer) for layer, alpha in alphas.items() if alpha == 0],
                        {layer: alpha for layer, alpha in alphas.items() if alpha > 0})
    means = branch_means(model, shift_windows.ids, sorted(alphas), skip_first=shift_windows.bos)
    return replaced(model, [], alphas, {layer: m_b - alphas[layer] * m_p for layer, (m_b, m_p) in means.items()})


def perplexity(model: torch.nn.Module, windows: np.ndarray) -> float:
    """transformers' own loss (labels = inputs, shifted inside) averaged over equal-length windows, exponentiated."""
    with torch.no_grad():
        losses = [model(torch.tensor(row[None]), labels=torch.tensor(row[None])).loss.double() for row in windows]
    return float(torch.exp(torch.stack(losses).mean()))


class _Fitted(torch.nn.Module):
    """An attention module replaced by a fitted map of its (normalized) input: x W + b."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray, dtype) -> None:
        super().__init__()
        self.weight = torch.tensor(weight, dtype=dtype)
        self.bias = torch.tensor(bias, dtype=dtype)

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states @ self.weight + self.bias, None


class _FittedPrevious(_Fitted):
    """An attention module replaced by a map of its input and the previous token's: [x_t, x_{t-1}] W + b, x_{-1} = 0
    (whole sequences only: no cache, no padding)."""

    def forward(self, hidden_states, *args, **kwargs):
        before = torch.cat([torch.zeros_like(hidden_states[:, :1]), hidden_states[:, :-1]], dim=1)
        return torch.cat([hidden_states, before], dim=-1) @ self.weight + self.bias, None


def with_previous(states: np.ndarray, rows: int) -> np.ndarray:
    """[x_t, x_{t-1}] (x_{-1} = 0) of the flattened states of `rows` equal-length windows."""
    states = states.reshape(rows, -1, states.shape[-1])
    before = np.concatenate([np.zeros_like(states[:, :1]), states[:, :-1]], axis=1)
    return np.concatenate([states, before], axis=-1).reshape(-1, 2 * states.shape[-1])


def attention_io(model: torch.nn.Module, windows: np.ndarray, index: int) -> tuple[np.ndarray, np.ndarray]:
    """(normalized input, branch output) of layer `index`'s attention at every token of `windows`, float64, from
    PyTorch hooks; the branch output is taken after a post-attention norm where the family has one."""
    layer = model.model.layers[index]
    post = layer.post_attention_layernorm if hasattr(layer, "post_feedforward_layernorm") else None
    states, targets = [], []

    def hook(module, args, kwargs, output):
        branch = output[0] if post is None else post(output[0])
        states.append(kwargs["hidden_states"].reshape(-1, branch.shape[-1]).double())
        targets.append(branch.reshape(-1, branch.shape[-1]).double())

    handle = layer.self_attn.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        for row in windows:
            model(torch.tensor(row[None]), use_cache=False)
    handle.remove()
    return torch.cat(states).numpy(), torch.cat(targets).numpy()


def fitted(model: torch.nn.Module, windows: np.ndarray, layers, ridge: float, previous: bool = False):
    """The reference for the fit move, fitted here from PyTorch hooks: bottom-up, each layer's attention input
    (normalized X; with `previous`, [X_t, X_{t-1}] within each window) mapped to its branch output (after a
    post-attention norm, which goes too), by a ridge solve of the augmented least squares (lambda = ridge *
    mean(diag(A^T A))) written with numpy's lstsq. Returns the model with the maps in place and the maps."""
    model = copy.deepcopy(model)
    dtype = next(model.parameters()).dtype
    maps = {}
    for index in sorted(layers):
        layer = model.model.layers[index]
        x, y = attention_io(model, windows, index)
        if previous:
            x = with_previous(x, len(windows))
        a = np.concatenate([x, np.ones((len(x), 1))], axis=1)
        lam = ridge * np.mean(np.sum(a * a, axis=0))
        stacked = np.concatenate([a, np.sqrt(lam) * np.eye(a.shape[1])])
        solution = np.linalg.lstsq(stacked, np.concatenate([y, np.zeros((a.shape[1], y.shape[1]))]), rcond=None)[0]
        maps[index] = (solution[:-1], solution[-1])
        _put_map(layer, *maps[index], dtype)
    return model, maps


def with_maps(model: torch.nn.Module, maps: dict) -> torch.nn.Module:
    """A copy of `model` with each layer of `maps` (layer -> layerdrop's FittedMap, or (W, b) as `fitted` returns)
    replaced by its map, as the fit move does."""
    model = copy.deepcopy(model)
    dtype = next(model.parameters()).dtype
    for index, found in maps.items():
        weight, bias = (found.weight, found.bias) if hasattr(found, "weight") else found
        _put_map(model.model.layers[index], weight, bias, dtype)
    return model


def _put_map(layer: torch.nn.Module, weight: np.ndarray, bias: np.ndarray, dtype) -> None:
    layer.self_attn = (_FittedPrevious if len(weight) == 2 * weight.shape[1] else _Fitted)(weight, bias, dtype)
    if hasattr(layer, "post_feedforward_layernorm"):  # the post-attention norm goes with the branch
        layer.post_attention_layernorm = torch.nn.Identity()


class _Transformed(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, transform: np.ndarray, dtype) -> None:
        super().__init__()
        self.inner = inner
        self.transform = torch.tensor(transform, dtype=dtype)

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs) @ self.transform


def replaceme_reference(model: torch.nn.Module, windows: np.ndarray, count: int, ridge: float):
    """ReplaceMe computed here from PyTorch hooks: the start whose h_i, h_{i+count} are closest by cosine, T by
    numpy's lstsq with ridge rows, and the model with blocks i+1..i+count removed and block i's MLP output
    (after a post-feedforward norm, if any) multiplied by T. Returns (model, start, T)."""
    layers = model.model.layers
    outputs, branches = {}, {}
    handles = []
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(
            lambda m, a, o, i=index: outputs.setdefault(i, []).append((o[0] if isinstance(o, tuple) else o)[0])))
        last = layer.post_feedforward_layernorm if hasattr(layer, "post_feedforward_layernorm") else layer.mlp
        handles.append(last.register_forward_hook(lambda m, a, o, i=index: branches.setdefault(i, []).append(o[0])))
    with torch.no_grad():
        for row in windows:
            model(torch.tensor(row[None]), use_cache=False)
    for handle in handles:
        handle.remove()
    h = {i: torch.cat(v).double().numpy() for i, v in outputs.items()}
    m = {i: torch.cat(v).double().numpy() for i, v in branches.items()}

    def distance(a, b):
        return float(np.mean(1 - (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))))

    start = min((i for i in h if i + count in h), key=lambda i: (distance(h[i], h[i + count]), i))
    x, y = m[start], h[start + count] - h[start] + m[start]
    lam = ridge * np.mean(np.sum(x * x, axis=0))
    transform = np.linalg.lstsq(np.concatenate([x, np.sqrt(lam) * np.eye(x.shape[1])]),
                                np.concatenate([y, np.zeros((x.shape[1], y.shape[1]))]), rcond=None)[0]
    result = replaced(model, [("block", k) for k in range(start + 1, start + 1 + count)])
    layer = result.model.layers[start]
    dtype = next(result.parameters()).dtype
    if hasattr(layer, "post_feedforward_layernorm"):
        layer.post_feedforward_layernorm = _Transformed(layer.post_feedforward_layernorm, transform, dtype)
    else:
        layer.mlp = _Transformed(layer.mlp, transform, dtype)
    return result, start, transform
