"""The `layerdrop` command: a thin layer over layerdrop.api. Errors become one line and an exit code."""

from __future__ import annotations

import os
import signal
import sys
import traceback

from layerdrop.cli.parser import build_parser
from layerdrop.errors import LayerdropError


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `layerdrop` console command; returns the exit code."""
    parser = build_parser()
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "tasks", None):  # lm-eval's standard tasks download their data; nothing else may
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from layerdrop.cli.commands import COMMANDS

        return COMMANDS[args.command](args)
    except LayerdropError as exc:
        if debug:
            traceback.print_exc()
        print(f"layerdrop: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # a long job's message says how to resume it
        print(f"layerdrop: interrupted; {exc or 'no partial output was left'}", file=sys.stderr)
        return 130
    except MemoryError:
        print("layerdrop: error: out of memory; use fewer --samples, a shorter --seq-len or --batch 1",
              file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line, never a traceback
        if debug:
            traceback.print_exc()
        reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        print(f"layerdrop: error: {type(exc).__name__}: {reason} (rerun with --debug for details)", file=sys.stderr)
        return 1


def run() -> None:
    """The console command: `main`, then exit with its code.

    After Ctrl-C the process leaves through os._exit: CI saw CPython 3.11 kill itself with SIGINT at shutdown
    (exit -2) after `main` had handled the interrupt during torch.export; CPython keeps a flag for a
    KeyboardInterrupt seen in C-API code, which handling it in Python does not clear. Outputs are already
    cleaned up by the time `main` returns.
    """
    code = main()
    if code == 130:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(code)
