"""Node mode's cache port admits only its policy's engines, against the real LMCache server the
sidecar runs as a node cache pod (request port on all addresses, the policy's keys mounted as the
operator mounts them): the policy's client stores and hits; a client without keys (a pod that only
labels itself), with another policy's keys (another policy or namespace), or with a keypair of its
own gets no answer to CLEAR, LOOKUP, a store or a code-running pickle, and none of them reaches a
handler: the policy's KV still hits, no marker file appears, the unpickler never saw a payload."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvoffload import contract
from tests.support.cache_keys import policy_keys, self_made_client
from tests.support.sidecar_harness import Sidecar, lmcache_client_on

pytestmark = pytest.mark.sidecar


def test_only_the_policys_own_key_reaches_the_node_caches_store_read_clear_or_pickle_path(
    make_sidecar: Callable[..., Sidecar], tmp_path: Path
) -> None:
    server_keys, own_client = policy_keys(tmp_path, "llama")
    _, other_policy = policy_keys(tmp_path, "mistral")
    _, other_namespace = policy_keys(tmp_path, "llama", namespace="team-b")
    self_made = self_made_client(tmp_path, server_keys)
    sidecar = make_sidecar(**{contract.ENV_REQUEST_HOST: "0.0.0.0", contract.ENV_CACHE_KEYS_DIR: str(server_keys)})
    sidecar.wait_ready()

    def client(op: str, argument: int | str, keys: Path | None) -> dict[str, object]:
        return lmcache_client_on(sidecar.request_port, sidecar.lmcache_http_port, op, argument, keys)

    assert client("store", 7, own_client) == {"stored": True, "chunks": 2}
    assert client("lookup", 7, own_client)["hit"] == 2

    strangers = {"no key (labels itself)": None, "another policy's key": other_policy,
                 "another namespace's key": other_namespace, "a keypair of its own": self_made}  # fmt: skip
    for who, keys in strangers.items():
        marker = tmp_path / f"code-ran-{who.replace(' ', '-')}"
        assert client("stranger", str(marker), keys) == {"answered": [], "registered": False}, who
        assert not marker.exists(), who
        assert client("lookup", 7, own_client)["hit"] == 2, f"{who} cleared the policy's cache"
    log = sidecar.log_path.read_text(errors="replace")
    assert "refused a pickled global" not in log, "a stranger's pickle reached the unpickler"
    # The keypair of its own got through CURVE's handshake (it knew the server's public key) and was
    # refused by the allow-list; the other keys never complete the handshake (another server's key).
    assert "event=cache_client_refused reason=unknown_key" in log
    # Control: the very same client with the policy's key gets in (the silence above is the port's), and
    # the restricted unpickler still refuses its code.
    control = client("stranger", str(tmp_path / "own-code-ran"), own_client)
    assert control["answered"] == ["clear", "lookup"] and control["registered"] and control["stored"], control
    assert control["committed"] is not True and not (tmp_path / "own-code-ran").exists(), control
