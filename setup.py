"""Build glue: installs `layerdrop-lm-eval.pth`, which makes `lm_eval --model layerdrop` find layerdrop's model.

Everything else about the package is in pyproject.toml. The .pth goes into site-packages for a normal install
(build_py) and for an editable install (editable_wheel), and pip removes it on uninstall.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "layerdrop-lm-eval.pth"
# A .pth runs its "import" lines at every interpreter start; this one stays quiet when layerdrop cannot be
# imported (an editable checkout that was moved or deleted) instead of printing a traceback each time.
LINE = 'import sys; exec("try:\\n import layerdrop._lm_eval_hook\\nexcept ImportError:\\n pass")\n'



class BuildWithPth(build_py):
    def run(self):
        super().run()
        (Path(self.build_lib) / PTH).write_text(LINE)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


class _StrategyWithPth:
    """Wraps setuptools' editable strategy so the editable wheel carries the .pth too."""

    def __init__(self, strategy):
        self.strategy = strategy

    def __call__(self, wheel, files, mapping):
        self.strategy(wheel, files, mapping)
        wheel.writestr(PTH, LINE.encode())

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self.strategy.__exit__(*exc)


class EditableWithPth(editable_wheel):
    def _select_strategy(self, *args, **kwargs):
        return _StrategyWithPth(super()._select_strategy(*args, **kwargs))


setup(cmdclass={"build_py": BuildWithPth, "editable_wheel": EditableWithPth})
