"""``python -m weightbus.cli``: the same as the ``weightbus`` console script."""

from weightbus.cli import main

main()
