"""ONNX Runtime sessions over layerdrop model folders and in-memory onnx-ir models, CUDA when it really works."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir
import onnxruntime as ort

from layerdrop.errors import LayerdropError

_PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}


def _options(threads: int | None, profile_prefix: str | None, optimize: bool, arena: bool) -> ort.SessionOptions:
    options = ort.SessionOptions()
    if not optimize:  # node names then match the ONNX graph one to one (used for profiles)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.enable_cpu_mem_arena = arena
    options.log_severity_level = 3  # a missing CUDA library is reported by our one notice line, not a red log
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return options


def make_session(
    model: ir.Model | Path,
    *,
    folder: Path | None = None,
    provider: str = "cpu",
    threads: int | None = None,
    profile_prefix: str | None = None,
    optimize: bool = True,
    arena: bool = True,
) -> ort.InferenceSession:
    """Create an ONNX Runtime session.

    Args:
        model: an .onnx path, or an in-memory onnx-ir model whose external weights live in `folder`
            (serialized without copying the weights; ONNX Runtime reads them from `folder`).
        provider: "cpu", "cuda" (falls back to CPU with one notice line when CUDA cannot be used) or "auto".
        threads: intra-op threads (None: ONNX Runtime's default).
        optimize: apply ONNX Runtime's graph optimizations (off: node names stay those of the ONNX graph).
        arena: use the CPU memory arena (off: memory figures show what the model really needs).

    Raises:
        LayerdropError: the graph is rejected by ONNX Runtime, or the provider name is unknown.
    """
    if provider == "auto":
        provider = "cuda" if "CUDAExecutionProvider" in ort.get_available_providers() else "cpu"
    if provider not in _PROVIDERS:
        raise LayerdropError(f"unknown provider {provider!r}; use cpu, cuda or auto")
    if provider == "cuda" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()  # onnxruntime-gpu finds CUDA and cuDNN where PyTorch's wheels installed them
    options = _options(threads, profile_prefix, optimize, arena)
    if not isinstance(model, ir.Model) and (Path(model).parent / "genai_config.json").is_file():
        from layerdrop import model_folder

        # builder graphs, run as they are but with a static cache head size (see model_folder)
        folder, model = model_folder.load(model)
        folder = folder.path
    if isinstance(model, ir.Model):
        if folder is None:
            raise ValueError("an in-memory model needs the folder that holds its external data")
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
        source: str | bytes = ir.serde.serialize_model(model).SerializeToString()
    else:
        source = str(model)
    try:
        session = ort.InferenceSession(source, options, providers=_PROVIDERS[provider])
    except Exception as exc:  # noqa: BLE001 - ORT raises its own Fail/InvalidGraph/RuntimeException types
        raise LayerdropError(f"ONNX Runtime rejects this model: {str(exc).splitlines()[0][:300]}") from None
    if provider == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        print("layerdrop: CUDA is not usable here (onnxruntime-gpu and CUDA libraries needed); running on CPU",
              file=sys.stderr)
    return session


@dataclass(frozen=True)
class RunOptions:
    """How a command runs its graphs in ONNX Runtime: the provider ("cpu", "cuda" or "auto", see `make_session`),
    intra-op threads (None: ONNX Runtime's default) and windows per run (`batch_size`)."""

    provider: str = "cpu"
    threads: int | None = None
    batch_size: int = 1

    def session(self, model: ir.Model | Path, *, folder: Path | None = None, **options) -> ort.InferenceSession:
        """`make_session(model, folder=folder, ...)` with this provider and these threads; `options` as there."""
        return make_session(model, folder=folder, provider=self.provider, threads=self.threads, **options)


def active_provider(session: ort.InferenceSession) -> str:
    """'cuda' when the session really runs on CUDA, else 'cpu'."""
    return "cuda" if session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
