"""Small ONNX Runtime helpers for tests (the runtime package's own API is what is under test elsewhere)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from layerdrop.runtime.feeds import prefill_feed


def session(folder: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(Path(folder) / "model.onnx"), options, providers=["CPUExecutionProvider"])


def ort_logits(folder: Path, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    sess = session(folder)
    return sess.run(["logits"], prefill_feed(sess, ids, mask))[0]
