"""``python -m trainguard`` is the ``trainguard`` command."""

from trainguard.face.cli import main

main()
