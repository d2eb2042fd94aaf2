"""TracIn's scoring and report; the callback is :class:`~lightning_gradcomp.callbacks.TracIn`."""
