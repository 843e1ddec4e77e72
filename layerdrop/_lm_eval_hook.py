"""Makes `lm_eval --model layerdrop` work: registers layerdrop's model when lm-eval loads its model list.

lm-eval has no plugin entry point for models, so the package installs a one-line `.pth` file that imports this
module at interpreter start. It only adds an import hook (no lm-eval or ONNX import happens here); when
`lm_eval.models` is imported, the name `layerdrop` is registered as a lazy placeholder for
`layerdrop.runtime.harness:LayerdropLM`.
"""

from __future__ import annotations

import importlib.abc
import sys

TARGET = "lm_eval.models"
MODEL = "layerdrop.runtime.harness:LayerdropLM"


def register() -> None:
    """Register `layerdrop` in lm-eval's model registry (no-op when it is already there)."""
    from lm_eval.api.registry import model_registry

    if "layerdrop" not in model_registry:
        model_registry.register("layerdrop", target=MODEL)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        try:
            register()
        except Exception as exc:  # noqa: BLE001 - never break lm-eval itself over this
            print(f"layerdrop: could not register the lm-eval model: {exc}", file=sys.stderr)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Add the import hook once (or register at once when lm-eval's models are already loaded)."""
    if TARGET in sys.modules:
        register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
