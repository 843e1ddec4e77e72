"""Minimal reproduction against the installed onnxruntime-genai: its RecurrentState carrying a [batch, d, 1]
`conv_state` next to a KV cache, as layerdrop's previous-token maps use it.

A hand-built graph over a vocabulary of 11: logits = A[token] + B[previous token] + D (sum of cached one-hots), where
the previous token comes from the carried state and the sum from the KV cache; greedy tokens are checked against
numpy. Prints one line per finding. Run: python benchmarks/genai_recurrent_state_repro.py
"""
import json
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime_genai as og
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

V, PAD = 11, 0
RIGHT = False  # pad a batch on the right (onnxruntime-genai's convention) or on the left
rng = np.random.default_rng(0)
A = rng.normal(size=(V, V)).astype(np.float32)   # current token -> logits
B = (3 * rng.normal(size=(V, V))).astype(np.float32)   # previous token (the state) -> logits
D = (0.3 * rng.normal(size=(V, V))).astype(np.float32)  # sum of cached keys -> logits
A[:, V - 1] -= 100  # never the end token
A[:, PAD] -= 100  # nor the pad token
E = np.eye(V, dtype=np.float32)
E[PAD] = 1.0  # make the pad token NOT zero so only the mask hides it


def build(path: Path, model_type: str, order_safe: bool, last_real=False, prev_from_kv=False, recurrent_rank=4,
          with_recurrent=True, conv_shape=None) -> Path:
    """The graph and its genai_config.json in `path`: the present state from the last real position (`last_real`)
    or the last position, ordered after the past state's read or not (`order_safe`), the previous token from the
    state or from the KV cache (`prev_from_kv`, batch 1), with or without the recurrent_state companion."""
    conv_shape = conv_shape or ["batch", V, 1]
    inputs = [h.make_tensor_value_info("input_ids", T.INT64, ["batch", "seq"]),
              h.make_tensor_value_info("attention_mask", T.INT64, ["batch", "total"]),
              h.make_tensor_value_info("position_ids", T.INT64, ["batch", "seq"]),
              h.make_tensor_value_info("past_key_values.0.key", T.FLOAT, ["batch", 1, "past", V]),
              h.make_tensor_value_info("past_key_values.0.value", T.FLOAT, ["batch", 1, "past", V]),
              h.make_tensor_value_info("past_key_values.0.conv_state", T.FLOAT, conv_shape)]
    outputs = [h.make_tensor_value_info("logits", T.FLOAT, ["batch", "seq", V]),
               h.make_tensor_value_info("present.0.key", T.FLOAT, ["batch", 1, "total", V]),
               h.make_tensor_value_info("present.0.value", T.FLOAT, ["batch", 1, "total", V]),
               h.make_tensor_value_info("present.0.conv_state", T.FLOAT, conv_shape)]
    if with_recurrent:
        shape = ["batch", 1, 1, 1][:recurrent_rank]
        inputs.append(h.make_tensor_value_info("past_key_values.0.recurrent_state", T.FLOAT, shape))
        outputs.append(h.make_tensor_value_info("present.0.recurrent_state", T.FLOAT, shape))
    inits = [nh.from_array(E, "E"), nh.from_array(A, "A"), nh.from_array(B, "B"), nh.from_array(D, "D"),
             nh.from_array(np.array([1], np.int64), "one"), nh.from_array(np.array([2], np.int64), "two"),
             nh.from_array(np.array([-1], np.int64), "m1"), nh.from_array(np.array([0], np.int64), "zero"),
             nh.from_array(np.array([2 ** 62], np.int64), "end"),
             nh.from_array(np.array([0, 1, V], np.int64), "state_rows"),
             nh.from_array(np.array([0, V, 1], np.int64), "conv_rows")]
    n = []
    n.append(h.make_node("Gather", ["E", "input_ids"], ["x"]))                          # [b,s,V]
    n.append(h.make_node("Shape", ["input_ids"], ["s"], start=1, end=2))
    n.append(h.make_node("Neg", ["s"], ["negs"]))
    n.append(h.make_node("Slice", ["attention_mask", "negs", "end", "one"], ["newmask"]))  # [b,s]
    n.append(h.make_node("Cast", ["newmask"], ["newmaskf"], to=T.FLOAT))
    n.append(h.make_node("Unsqueeze", ["newmaskf", "two"], ["m3"]))
    n.append(h.make_node("Mul", ["x", "m3"], ["xm"]))
    n.append(h.make_node("Reshape", ["past_key_values.0.conv_state", "state_rows"], ["state"]))  # [b,1,V]
    n.append(h.make_node("Concat", ["state", "xm"], ["joined"], axis=1))
    if prev_from_kv:  # the previous token from the KV cache (which genai reorders for beams): batch 1 only
        n.append(h.make_node("Squeeze", ["past_key_values.0.key", "one"], ["pk"]))
        n.append(h.make_node("Concat", ["pk", "xm"], ["joinedkv"], axis=1))
        n.append(h.make_node("Shape", ["joinedkv"], ["jl"], start=1, end=2))
        n.append(h.make_node("Sub", ["jl", "s"], ["st0"]))
        n.append(h.make_node("Sub", ["st0", "one"], ["st"]))
        n.append(h.make_node("Max", ["st", "zero"], ["stc"]))
        n.append(h.make_node("Slice", ["joinedkv", "stc", "m1", "one"], ["prev_raw"]))
        n.append(h.make_node("Pad", ["prev_raw", "padspec"], ["prev_p"]))
        n.append(h.make_node("Shape", ["xm"], ["xs"], start=1, end=2))
        n.append(h.make_node("Neg", ["xs"], ["nxs"]))
        n.append(h.make_node("Slice", ["prev_p", "nxs", "end", "one"], ["prev"]))
        inits.append(nh.from_array(np.array([0, 1, 0, 0, 0, 0], np.int64), "padspec"))
    else:
        n.append(h.make_node("Slice", ["joined", "zero", "m1", "one"], ["prev"]))
    # present state: from `joined` (so it is written only after the past state was read) or from `xm` (not ordered)
    if last_real:
        inits.append(nh.from_array(np.ones((1, 1), np.float32), "onef"))
        inits.append(nh.from_array(np.array(0.0, np.float32), "zf"))
        n.append(h.make_node("Shape", ["newmaskf"], ["mshape"], start=0, end=1))
        n.append(h.make_node("Concat", ["mshape", "one"], ["oshape"], axis=0))
        n.append(h.make_node("Expand", ["onef", "oshape"], ["ones_b"]))
        n.append(h.make_node("Concat", ["ones_b", "newmaskf"], ["jm"], axis=1))
        n.append(h.make_node("CumSum", ["jm", "one"], ["later"], exclusive=1, reverse=1))
        n.append(h.make_node("Equal", ["later", "zf"], ["nolater"]))
        n.append(h.make_node("Cast", ["nolater"], ["nolaterf"], to=T.FLOAT))
        n.append(h.make_node("Mul", ["jm", "nolaterf"], ["w"]))
        n.append(h.make_node("Unsqueeze", ["w", "one"], ["w3"]))
        n.append(h.make_node("MatMul", ["w3", "joined"], ["last"]))
    else:
        n.append(h.make_node("Slice", ["joined" if order_safe else "xm", "m1", "end", "one"], ["last"]))
    n.append(h.make_node("Reshape", ["last", "conv_rows"], ["present.0.conv_state"]))
    if with_recurrent:
        n.append(h.make_node("Identity", ["past_key_values.0.recurrent_state"], ["present.0.recurrent_state"]))
    # KV: key = value = masked one-hot, appended to the cache
    n.append(h.make_node("Unsqueeze", ["xm", "one"], ["k"]))
    n.append(h.make_node("Concat", ["past_key_values.0.key", "k"], ["present.0.key"], axis=2))
    n.append(h.make_node("Concat", ["past_key_values.0.value", "k"], ["present.0.value"], axis=2))
    n.append(h.make_node("ReduceSum", ["present.0.key", "two"], ["ksum"], keepdims=0))  # [b,1,V]
    n.append(h.make_node("MatMul", ["x", "A"], ["la"]))
    n.append(h.make_node("MatMul", ["prev", "B"], ["lb"]))
    n.append(h.make_node("MatMul", ["ksum", "D"], ["ld"]))
    n.append(h.make_node("Add", ["la", "lb"], ["lab"]))
    n.append(h.make_node("Add", ["lab", "ld"], ["logits"]))
    graph = h.make_graph(n, "repro", inputs, outputs, inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    path.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path / "model.onnx"))
    config = {"model": {"bos_token_id": 1, "eos_token_id": V - 1, "pad_token_id": PAD, "context_length": 64,
                        "vocab_size": V, "type": model_type,
                        "decoder": {"session_options": {"log_id": "g", "provider_options": []},
                                    "filename": "model.onnx", "head_size": V, "hidden_size": V,
                                    "num_attention_heads": 1, "num_key_value_heads": 1, "num_hidden_layers": 1,
                                    "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                                               "position_ids": "position_ids",
                                               "past_key_names": "past_key_values.%d.key",
                                               "past_value_names": "past_key_values.%d.value"},
                                    "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                                                "present_value_names": "present.%d.value"}}},
              "search": {"do_sample": False, "max_length": 64, "num_beams": 1, "past_present_share_buffer": False}}
    (path / "genai_config.json").write_text(json.dumps(config))
    return path


def reference(prompt, steps):
    """numpy: greedy tokens with the previous token behind zeros at the first real token."""
    toks, out = list(prompt), []
    for _ in range(steps):
        t, p = toks[-1], (toks[-2] if len(toks) > 1 else None)
        ksum = sum(np.eye(V, dtype=np.float32)[u] if u != PAD else E[PAD] for u in toks)
        logit = E[t] @ A + (E[p] @ B if p is not None else 0) + ksum @ D
        nxt = int(np.argmax(logit))
        out.append(nxt)
        toks.append(nxt)
    return out


def genai(folder, prompts, steps, beams=1):
    """onnxruntime-genai's greedy tokens per prompt (or, with beams, every returned sequence)."""
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    width = max(map(len, prompts))
    params.set_search_options(max_length=width + steps, do_sample=False, num_beams=beams,
                              num_return_sequences=1 if beams == 1 else beams, batch_size=len(prompts))
    gen = og.Generator(model, params)
    padded = [p + [PAD] * (width - len(p)) if RIGHT else [PAD] * (width - len(p)) + p for p in prompts]
    gen.append_tokens(np.array(padded, dtype=np.int32))
    outs = [[] for _ in prompts]
    for _ in range(steps):
        gen.generate_next_token()
        for i, t in enumerate(gen.get_next_tokens()[:len(prompts)] if beams == 1 else []):
            outs[i].append(int(t))
    if beams > 1:
        return [list(gen.get_sequence(i)) for i in range(len(prompts) * beams)]
    return outs


def main() -> None:
    global RIGHT
    root = Path(tempfile.mkdtemp())
    prompts = [[3, 5, 7, 2, 9], [4, 8], [6]]
    for mtype in ("llama", "qwen2", "gemma3_text", "mistral", "phi3"):
        folder = build(root / mtype, mtype, True, last_real=True)
        print(mtype, "batch 1 carried:", all(genai(folder, [p], 8)[0] == reference(p, 8) for p in prompts))
    for last_real in (False, True):
        folder = build(root / f"last{last_real}", "llama", True, last_real=last_real)
        for RIGHT in (False, True):
            rows = genai(folder, prompts, 8)
            print("present =", "last real position" if last_real else "last position",
                  "| right-padded" if RIGHT else "| left-padded", "batch of 3:",
                  [rows[i] == reference(p, 8) for i, p in enumerate(prompts)])
    RIGHT = True
    for name, kw in (("no recurrent_state", dict(with_recurrent=False)), ("rank-3 recurrent_state",
                     dict(recurrent_rank=3)), ("dynamic conv_state dim", dict(conv_shape=["batch", "d", 1]))):
        try:
            folder = build(root / name.replace(" ", "_"), "llama", True, last_real=True, **kw)
            print(name, genai(folder, [prompts[0]], 8)[0] == reference(prompts[0], 8))
        except Exception as error:  # noqa: BLE001 - the finding is the error
            print(name, "ERROR", str(error).splitlines()[0][:160])
    state = build(root / "state", "llama", True, last_real=True)
    exact = build(root / "kv", "llama", True, prev_from_kv=True)  # the previous token from the reordered KV cache
    for prompt in ([3, 5, 7, 2, 9], [2, 3]):
        print("beam search (3 beams) as with the state in the KV cache:", genai(state, [prompt], 8, 3) ==
              genai(exact, [prompt], 8, 3))
    model = og.Model(str(state))
    for trial in range(2):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=20, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([[4, 8]], dtype=np.int32))
        tokens = []
        for _ in range(6):
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
        print("generator", trial, "starts from a zero state:", tokens == reference([4, 8], 6))
    for index in (0, 3):  # after 8 tokens
        try:
            generator.rewind_to(index)
            print("rewind_to", index, "accepted")
        except Exception as error:  # noqa: BLE001 - the finding is the error
            print("rewind_to", index, "ERROR", str(error)[:120])
        generator.append_tokens(np.array([[4, 8, 3, 2, 6, 6, 8, 8]], dtype=np.int32))


if __name__ == "__main__":
    main()
