"""``python -m trainguard`` is the ``trainguard`` command."""

from trainguard.cli import main

main()
