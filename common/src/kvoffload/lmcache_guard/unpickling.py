"""The restricted unpickler.

Why: LMCache 0.5.6 unpickles the ``cpu_data`` of every engine-driven COMMIT_STORE that
carries bytes (``v1/multiprocess/modules/server_transfer.py``, ``pickle.loads``), from any
client that reaches its request port, authenticated or not. A pickle may name any callable,
so a foreign client could run code in the cache server. Here that module's ``pickle`` is
replaced by one whose ``loads`` runs no pickle machinery at all: ``kvoffload.tensor_payload`` reads
the opcodes of what LMCache's pickle transport sends (a list of CPU tensors) with a stack machine of
its own, hands no real function or existing object to the payload, fills each storage from exactly
the bytes sent and checks every tensor's geometry against it. Anything else is refused before a
tensor is built, and the COMMIT fails as a bad payload would: one keyholder can neither change how
the server rebuilds other clients' tensors nor make it store (and hand back) memory it never wrote.
"""

from __future__ import annotations

import importlib
import pickle
import sys
import types
from typing import Any

from kvoffload.lmcache_guard import LMCacheVersionError, check_lmcache_version, is_guard

UNPICKLING_MODULE = "lmcache.v1.multiprocess.modules.server_transfer"
"""The one module of the server that unpickles request data (its ``pickle`` global is replaced)."""


def restricted_loads(data: bytes) -> list[Any]:
    """``pickle.loads`` for LMCache's tensor payloads only (``tensor_payload.decode_tensor_list``: no
    pickle machinery runs); raises ``TensorPayloadError`` (a ``pickle.UnpicklingError``) for anything else."""
    from kvoffload.tensor_payload import decode_tensor_list  # torch is imported only by servers

    return decode_tensor_list(data)


def install_restricted_unpickler() -> None:
    """Check the version, then make LMCache's server unpickle request data with ``restricted_loads``.

    Fails (``LMCacheVersionError``) rather than start a server whose unpickling site moved.
    """
    check_lmcache_version()
    target = importlib.import_module(UNPICKLING_MODULE)
    current = getattr(target, "pickle", None)
    if current is not pickle and not is_guard(current):
        raise LMCacheVersionError(f"{UNPICKLING_MODULE} no longer unpickles through its 'pickle' global")
    target.pickle = types.SimpleNamespace(  # type: ignore[attr-defined]
        loads=restricted_loads,
        dumps=pickle.dumps,
        UnpicklingError=pickle.UnpicklingError,
        kvoffload_guard=True,
    )


def unpickler_is_restricted() -> bool:
    """Whether this process's LMCache server unpickles through ``restricted_loads``."""
    module = sys.modules.get(UNPICKLING_MODULE)
    return module is not None and is_guard(getattr(module, "pickle", None))
