"""The wires the proxy serves, one registration line each (docs/architecture.md, "A new wire").

Everything that knows which wires exist reads :data:`WIRES`: the proxy's routes and the error shape of
each (``app``, ``middleware``), and ``make demo``'s count of chat answers (``ops.demo_metrics``).
"""

from __future__ import annotations

from services.proxy import messages_api, openai_api, responses_api
from services.proxy.wire import Wire
from shared.registry import Registry

WIRES: Registry[Wire] = Registry("wire", {wire.route: wire for wire in (
    openai_api.WIRE,
    responses_api.WIRE,
    messages_api.WIRE,
)})
"""Route (``/v1/...``) -> the wire that serves it, in registration order."""
