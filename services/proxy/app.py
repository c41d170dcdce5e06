"""HTTP shell of the proxy: ``create_app(settings) -> FastAPI``.

Reads like a table of contents: the lifespan opens what the app owns (:mod:`services.proxy.lifespan`);
each registered wire (:mod:`services.proxy.wires`) is served by the one chat endpoint
(:mod:`services.proxy.chat_route`), by headers or API key and by a session key in the path; the proxy's
own routes are :mod:`services.proxy.routes`; errors are mapped to HTTP and requests counted in
:mod:`services.proxy.middleware`. The app's routes are the one list of them: metrics and logs label
requests from it. The chat route, the hot one, is answered by a :class:`~shared.http_server.DirectRoute`
past FastAPI's per-route layers.
"""

from __future__ import annotations

from fastapi import FastAPI

from services.proxy import openai_api
from services.proxy.auth import Auth
from services.proxy.chat_route import ChatRoute
from services.proxy.lifespan import lifespan
from services.proxy.middleware import RequestCounter, RouteLabels, install_error_handlers, too_large
from services.proxy.routes import add_own_routes
from services.proxy.session_keys import KeySigner
from services.proxy.settings import ProxySettings
from services.proxy.wires import WIRES
from shared.errors import ReinError
from shared.http_server import APP_OPTIONS, BodyLimit, DirectRoute
from shared.model import load_tokenizer


def create_app(settings: ProxySettings) -> FastAPI:
    tokenizer = load_tokenizer(settings.model)  # REIN_MODEL's chat template; no weights (for tiny, no torch)
    auth = Auth(settings.admin_token, settings.runner_token, settings.open_sessions,
                KeySigner(settings.session_key_secret, settings.run_id, settings.session_key_ttl_s))
    app = FastAPI(title="rein proxy", lifespan=lifespan(settings, tokenizer), **APP_OPTIONS)

    # Every wire a thin adapter onto the same call (docs/agents.md, "Other wires").
    chat = ChatRoute(settings, auth)
    for wire in WIRES.values():
        app.add_api_route(wire.route, chat.by_headers(wire), methods=["POST"])
        app.add_api_route(f"/sessions/{{key}}{wire.route}", chat.by_path(wire), methods=["POST"])
    add_own_routes(app, settings, auth)

    label = RouteLabels(app.routes)
    rein_error = install_error_handlers(app, label)
    # the chat route, routed above as well, is answered past FastAPI's per-route layers (inside these two)
    app.add_middleware(DirectRoute, path=openai_api.WIRE.route, endpoint=chat.by_headers(openai_api.WIRE),
                       errors=(ReinError,), on_error=rein_error)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, reject=too_large)
    app.add_middleware(RequestCounter, label=label)
    return app
