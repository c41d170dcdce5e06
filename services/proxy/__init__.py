"""The OpenAI-compatible gateway every agent talks to.

Consumes: agents' chat calls on each registered wire (``wires``: ``/v1/chat/completions``,
``/v1/responses``, ``/v1/messages``) named by a session key, or by ``X-Session-Id`` (``X-Group-Id`` for
training sessions, ``X-Turn-Id``, ``X-Prompt-Id``, ``X-Attempt``, ``X-Rein-Soft-Reject``) with the runner's
token; the runner's ``POST /v1/sessions`` and
``POST /v1/sessions/{id}/finish`` (bearer ``REIN_RUNNER_TOKEN``); the weight broadcaster's
``/v1/rollout/pause|resume`` (bearer ``REIN_ADMIN_TOKEN``). Who may do what: ``auth``.

Produces: ``rollout.chunks`` (one :class:`shared.schemas.Chunk` per engine call,
key = group id, submitted before the agent gets its answer and acked before the
session's end is published) and ``rollout.events`` (``SessionFinished``,
``SessionRejected``). A session without ``X-Group-Id`` is
served but never published (not for training). Calls the engines' ``/generate``,
``/abort_request``, ``/get_model_info`` and ``/get_server_info``.

Owns (in memory, per process): the session store (per-segment token ids and
per-token versions, TITO message history), the pause flag and the set of engine
requests in flight, and each engine's last known weight version.

Modules: ``settings`` (ProxySettings), ``auth`` and ``session_keys`` (credentials, pure), ``sessions``
(pure store, TITO),
``generation`` (pause controller + preemptible loop), ``engine_client`` (over ``shared.http_client``),
``publisher`` (Kafka), ``service`` (what each endpoint does), ``wire`` and ``wires`` (what a wire is, the
registered ones: ``openai_api``, ``responses_api``, ``messages_api``), ``app`` (the routes, as a table of
contents: ``lifespan``, ``chat_route``, ``routes``, ``middleware`` for error mapping and request counts).
"""
