"""The request core's own vocabulary, free of any wire format: the front doors (router/convert.py
for gRPC) are the only places that map these to and from what travels."""

from __future__ import annotations

import enum


class RoutePath(enum.Enum):
    """The path a request asks for (AUTO: the router chooses) or takes."""

    AUTO = "auto"
    COLOCATED = "colocated"  # one decode worker prefills it in chunks next to its decodes
    DISAGGREGATED = "disaggregated"  # a prefill worker prefills it and streams the KV over
