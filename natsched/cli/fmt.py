"""How the command line writes ages, sizes and times.

The age and size formats are the inverses of what the CLI parses (``--max-age 7d``,
``--max-bytes 1GiB``: :func:`natsched.bus.provision.parse_duration` and ``parse_size``), so they
live beside those; a time is written as the audit names it in its messages.
"""

from __future__ import annotations

from natsched.audit.records import when
from natsched.bus.provision import fmt_age, fmt_size

__all__ = ["fmt_age", "fmt_size", "when"]
