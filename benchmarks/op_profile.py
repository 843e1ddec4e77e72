"""Where prefill time goes, by operator, in graphs of the same model side by side (ONNX Runtime's profiler).

    python benchmarks/op_profile.py bench-out/deploy/fp32/bench-base bench-out/deploy/fp32/builder \
        --seq 1024 --json bench-out/op-profile.json

Each folder gets a session as `bench` makes it (graph optimizations on, 2 threads) with profiling, one warm-up
and `--runs` profiled prefills of `--seq` random tokens; kernel times are summed per operator type and averaged
over the runs. The table shows ms per prefill for each operator type, its count of nodes, and the difference,
largest first: the operators that cost the gap between two graphs.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path


def op_times(folder: Path, seq: int, runs: int, threads: int) -> tuple[dict[str, float], dict[str, int], float]:
    """(ms per prefill by operator type, nodes by operator type, wall ms per prefill) from a profiled session."""
    import time

    from layerdrop.runtime.bench import _ids
    from layerdrop.runtime.feeds import prefill_feed
    from layerdrop.runtime.session import make_session

    with tempfile.TemporaryDirectory() as tmp:
        session = make_session(folder / "model.onnx", threads=threads, profile_prefix=os.path.join(tmp, "p"))
        feed = prefill_feed(session, _ids(seq, 1, session))
        session.run(["logits"], feed)
        start = time.perf_counter()
        for _ in range(runs):
            session.run(["logits"], feed)
        wall = (time.perf_counter() - start) * 1000 / runs
        events = json.loads(Path(session.end_profiling()).read_text())
    totals: dict[str, float] = defaultdict(float)
    nodes: dict[str, set] = defaultdict(set)
    for event in events:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            op = event.get("args", {}).get("op_name", "?")
            totals[op] += event["dur"]
            nodes[op].add(event["name"])
    calls = runs + 1  # the warm-up run is profiled too
    return ({op: t / calls / 1000 for op, t in totals.items()}, {op: len(n) for op, n in nodes.items()}, wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", type=Path, nargs=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    (a_ms, a_n, a_wall), (b_ms, b_n, b_wall) = (op_times(f, args.seq, args.runs, args.threads) for f in args.folders)
    ops = sorted(set(a_ms) | set(b_ms), key=lambda op: -abs(a_ms.get(op, 0) - b_ms.get(op, 0)))
    a, b = (f.name for f in args.folders)
    print(f"| operator ({args.seq} tokens, ms per prefill) | {a} | nodes | {b} | nodes | difference |")
    print("|---|---|---|---|---|---|")
    for op in ops:
        print(f"| {op} | {a_ms.get(op, 0):.1f} | {a_n.get(op, 0)} | {b_ms.get(op, 0):.1f} | {b_n.get(op, 0)} | "
              f"{a_ms.get(op, 0) - b_ms.get(op, 0):+.1f} |")
    print(f"| all kernels | {sum(a_ms.values()):.1f} | {sum(a_n.values())} | {sum(b_ms.values()):.1f} | "
          f"{sum(b_n.values())} | {sum(a_ms.values()) - sum(b_ms.values()):+.1f} |")
    print(f"| wall time of a profiled prefill | {a_wall:.1f} | | {b_wall:.1f} | | {a_wall - b_wall:+.1f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"seq": args.seq, "folders": [str(f) for f in args.folders],
                                         "ms": [a_ms, b_ms], "nodes": [a_n, b_n], "wall_ms": [a_wall, b_wall]},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
