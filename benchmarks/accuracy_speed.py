"""Issue 16: time of the plan's accuracy column for one row (`layerdrop plan`'s multiple-choice task through lm-eval).

    python benchmarks/accuracy_speed.py EXPORT [--items 200] [--threads 2]

Builds the plan's items from the default held-out text (a 32-token context, its true next 8 tokens against three
other windows' next 8) and prints the seconds lm-eval took to score them with the `layerdrop` model on EXPORT, and
the accuracy. On an export with a KV cache the four choices of an item share one run of their context. Run it from
a checkout of another commit (PYTHONPATH=that checkout) to compare two versions.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from layerdrop.api.common import open_model
from layerdrop.api.plan.measure import Measure
from layerdrop.api.plan.texts import HeldOut, accuracy_items
from layerdrop.runtime.session import RunOptions, make_session
from layerdrop.windows import Sampling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    folder, model = open_model(args.export)
    items = accuracy_items(folder.path, None, args.items, "", Sampling(), [])
    session = make_session(model, folder=folder.path, threads=args.threads)
    started = time.perf_counter()
    measure = Measure(model, folder.path, None, HeldOut(None, [], items), 1, RunOptions(threads=args.threads))
    accuracy = measure.accuracy(model, session).accuracy
    seconds = round(time.perf_counter() - started, 1)
    print(json.dumps({"export": str(args.export), "items": len(items), "seconds": seconds, "accuracy": accuracy}))


if __name__ == "__main__":
    main()
