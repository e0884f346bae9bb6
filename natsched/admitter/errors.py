"""Errors of the admitter package.

::

    AdmitterError
    ├── QuotaError          a quota edit that cannot be applied (floors over 100 %, negative values, a
    │                       cap below zero, an unknown class ...); the old quotas stay in force
    ├── UsageError          a shared usage value (KV ``inflight``/``usage``) that cannot be decoded
    └── SettingsError       an AdmissionSettings value out of range (also a ValueError)
"""

from natsched.errors import NatschedError


class AdmitterError(NatschedError):
    """Root of every admitter error."""


class QuotaError(AdmitterError):
    """A quota edit that cannot be applied; the old quotas stay in force."""


class UsageError(AdmitterError):
    """A serialised :class:`~natsched.admitter.usage.Usage` that is not one (garbage in the shared KV)."""


class SettingsError(AdmitterError, ValueError):
    """An admission setting that cannot be used (a share outside 0..1, a negative time ...)."""
