"""`python -m layerdrop.cli`: the same as the `layerdrop` command."""

from layerdrop.cli import run

run()
