"""The engine both strategies run on: one flat tensor averaged through a compressor, torch only.

A reduction's way down: :mod:`~lightning_gradcomp.engine.split` cuts a flat tensor (a DDP bucket, DiLoCo's
pseudo-gradient) into the layers a compressor takes and the ones averaged densely; the compressor's exchange yields
requests (:mod:`~lightning_gradcomp.engine.requests`) that :mod:`~lightning_gradcomp.engine.driver` issues as futures,
with error feedback (:mod:`~lightning_gradcomp.engine.error_feedback`) and the non-finite guard
(:mod:`~lightning_gradcomp.engine.staging`); :mod:`~lightning_gradcomp.engine.comm` packs payloads and counts their
bytes (:mod:`~lightning_gradcomp.engine.telemetry`, :mod:`~lightning_gradcomp.engine.wire`) on the process groups of
:mod:`~lightning_gradcomp.engine.collectives`. Nothing here imports Lightning or a strategy.
"""
