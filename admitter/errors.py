"""Errors of the admitter package.

::

    AdmitterError
    └── QuotaError        a quota edit that cannot be applied (e.g. floors over 100 %)
"""


class AdmitterError(Exception):
    """Root of every admitter error."""


class QuotaError(AdmitterError):
    """A quota edit that cannot be applied; the old quotas stay in force."""
