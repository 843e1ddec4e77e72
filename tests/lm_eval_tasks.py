"""Offline lm-eval tasks over local rows, for the tests and the harness benchmark (`runtime.tasks`)."""

from layerdrop.runtime.tasks import write_local_task

__all__ = ["write_local_task"]
