"""Node mode's request port, authenticated.

Node mode authenticates the request port (``require_curve_clients``): LMCache 0.5.6 builds its
request server on ``zmq.Context.instance()`` (``transport/zmq_impl/server.py``); here that module's
``MessageQueueServer`` gets a context of its own whose sockets are CURVE servers, with a ZAP
handler that admits only the policy's client key. A client without it never completes the
handshake, so none of its frames reaches a handler (store, lookup, clear, the unpickler).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from kvoffload.cache_keys import ServerKeys
from kvoffload.lmcache_guard import LMCacheVersionError, check_lmcache_version, is_guard
from kvoffload.log_budget import LogBudget

log = logging.getLogger(__name__)

REQUEST_SERVER_MODULE = "lmcache.v1.multiprocess.transport.zmq_impl.server"
"""The module that builds the request port's ``MessageQueueServer`` (its name there is replaced)."""
ZAP_DOMAIN = "kvoffload-cache"
_AUTHENTICATORS: list[Any] = []


class AllowedClients:
    """pyzmq's ZAP credentials provider: admits the listed Z85 client keys, logs refusals (on a
    budget: a stranger retrying its handshake in a loop gets a few lines and a count)."""

    def __init__(self, allowed: frozenset[str], refusals: LogBudget | None = None) -> None:
        self._allowed = allowed
        self._refusals = refusals or LogBudget(log)

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key.decode("ascii", "replace") in self._allowed
        if not allowed:
            self._refusals.warning("event=cache_client_refused reason=unknown_key domain=%s", domain)
        return allowed


def curve_server_context(keys: ServerKeys) -> Any:
    """A ``zmq.Context`` whose every socket is a CURVE server with ``keys``, and its running ZAP
    handler admitting only ``keys.allowed_clients`` (it lives as long as the process)."""
    import zmq
    from zmq.auth.thread import ThreadAuthenticator

    context = zmq.Context()
    authenticator = ThreadAuthenticator(context, log=log)
    authenticator.start()
    authenticator.configure_curve_callback(ZAP_DOMAIN, credentials_provider=AllowedClients(keys.allowed_clients))
    # Set after the ZAP socket exists: context-level options apply to the sockets created later.
    context.setsockopt(zmq.CURVE_SERVER, 1)
    context.setsockopt(zmq.CURVE_SECRETKEY, keys.secret.encode("ascii"))
    context.setsockopt(zmq.CURVE_PUBLICKEY, keys.public.encode("ascii"))
    context.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode("ascii"))
    _AUTHENTICATORS.append(authenticator)  # stopped when collected: it lives as long as the process
    return context


def require_curve_clients(keys: ServerKeys) -> None:
    """Check the version, then make LMCache's request server a CURVE server admitting only
    ``keys.allowed_clients``. Call before the server starts."""
    check_lmcache_version()
    target = importlib.import_module(REQUEST_SERVER_MODULE)
    original = getattr(target, "MessageQueueServer", None)
    if original is None or is_guard(original):
        raise LMCacheVersionError(f"{REQUEST_SERVER_MODULE} no longer builds a MessageQueueServer")
    curve_context = curve_server_context(keys)

    def authenticated_server(bind_url: str, context: Any = None) -> Any:
        del context  # LMCache passes zmq.Context.instance(): its sockets would admit anyone
        return original(bind_url=bind_url, context=curve_context)

    authenticated_server.kvoffload_guard = True  # type: ignore[attr-defined]
    target.MessageQueueServer = authenticated_server  # type: ignore[attr-defined]
