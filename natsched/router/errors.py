"""Errors of the router package.

::

    RouterError
    ├── NoWorkerError         no healthy worker can take the request now
    └── ConfigError           a setting or policy weight that cannot be used (also a ValueError)
        └── UnknownPolicyError  a policy name that make_policy() does not know
"""

from natsched.errors import NatschedError


class RouterError(NatschedError):
    """Root of every router error."""


class NoWorkerError(RouterError):
    """No healthy worker can take the request now."""


class ConfigError(RouterError, ValueError):
    """A router setting or policy weight is invalid.

    Also a ``ValueError`` so callers that validated input with ``except ValueError`` keep working.
    """


class UnknownPolicyError(ConfigError):
    """A routing-policy name that :func:`natsched.router.policies.make_policy` does not know."""
