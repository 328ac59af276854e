"""Skip lists: per-shard sidecars that leave samples out of an export without rewriting it.

:mod:`~prx_data.skips.sidecar` is the format and tree access;
:mod:`~prx_data.skips.optout`, :mod:`~prx_data.skips.dedup` and
:mod:`~prx_data.skips.rewrite` build on it.
"""
