"""Split the bundled mixed calibration text into its four kinds, for a search balanced by kind
(`benchmarks/cross_kind_choice.py --choose-on OUT/prose.txt+OUT/verse.txt+OUT/docs.txt+OUT/code.txt --per-text 4`).

    python benchmarks/split_mix.py OUT

The prose, technical-writing and code runs are rebuilt with `scripts/build_bundled_texts.py`'s own functions (with
CPython 3.11.7, as calib.txt was made; each run is checked to be in calib.txt), and what is left of calib.txt is the
verse. Writes OUT/prose.txt, OUT/verse.txt, OUT/docs.txt and OUT/code.txt.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import build_bundled_texts as build  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    data = ROOT / "layerdrop" / "data"
    calib = (data / "calib.txt").read_text()
    docs, code = build._stdlib_parts(Path(sysconfig.get_paths()["stdlib"]), build.MIXED_DOC_MODULES,
                                     build.MIXED_CODE_MODULES)
    sources = {"prose": (data / "prose.txt").read_text(), "docs": "\n\n".join(p.strip() for p in docs),
               "code": "\n\n".join(code)}
    args.out.mkdir(parents=True, exist_ok=True)
    rest = calib
    for kind, text in sources.items():
        runs = ["\n".join(line.rstrip() for line in run.split("\n"))
                for run in build._runs(text, build.MIXED_SHARE, build.MIXED_CHUNK)]
        missing = sum(run not in calib for run in runs)
        if missing:
            sys.exit(f"split_mix: {missing} of the {kind} runs are not in calib.txt; run with CPython 3.11.7")
        for run in runs:
            rest = rest.replace(run, "", 1)
        (args.out / f"{kind}.txt").write_text("\n\n".join(runs) + "\n")
    (args.out / "verse.txt").write_text("\n\n".join(p for p in rest.split("\n\n") if p.strip()) + "\n")
    print({f.name: f.stat().st_size for f in sorted(args.out.glob("*.txt"))})


if __name__ == "__main__":
    main()
