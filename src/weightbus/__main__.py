"""``python -m weightbus``: the same as the ``weightbus`` console script."""

from weightbus.cli import main

main()
