"""``python -m lightning_gradcomp``: the ``lightning-gradcomp`` command."""

from lightning_gradcomp.cli import main

main()
