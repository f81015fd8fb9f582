"""Errors the engine reports to a user as one line (:class:`sched_lab.core.errors.UserError`).
Bad inputs from the engine glue (a short block table, a token id out of range) raise
``ValueError`` instead."""

from __future__ import annotations

from sched_lab.core.errors import UserError


class CheckpointError(UserError):
    """A model directory is missing, incomplete or malformed (names the file or tensor)."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture or one of its options is not implemented here."""


class DeviceError(UserError):
    """The device cannot run what was asked (a dtype, an attention backend)."""


class KVCacheCapacityError(UserError):
    """Not even one KV block fits in the memory left for the cache."""
