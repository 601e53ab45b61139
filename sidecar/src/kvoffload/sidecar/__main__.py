"""``kvoffload-sidecar`` / ``python -m kvoffload.sidecar``: parse, validate, then run.

Bad configuration exits with code 2 and one line on stderr, before anything starts.
``--dry-run`` validates and prints the LMCache command (password-free) as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from kvoffload import contract

from .command import ServerCommand, build_server_command
from .endpoints import start_endpoints
from .l2fs import trim_before_start
from .settings import DEFAULT_POLICY_FILE, SettingsError, SidecarSettings, load_settings, parse_policy_text
from .supervisor import Supervisor, shm_free_bytes

PROG = "kvoffload-sidecar"
EXIT_BAD_CONFIG = 2
EXIT_CANNOT_START = 1
log = logging.getLogger("kvoffload.sidecar")


def read_policy(env: Mapping[str, str]) -> tuple[dict[str, Any] | None, str | None]:
    """The mounted policy spec and its path; a missing default file means no policy."""
    explicit = env.get(contract.ENV_POLICY_FILE, "")
    path = explicit or DEFAULT_POLICY_FILE
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        if explicit:
            raise SettingsError(
                f"{contract.ENV_POLICY_FILE}: {path!r} does not exist; "
                "point it at the mounted policy file or leave it unset"
            ) from None
        return None, None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise SettingsError(
            f"{contract.ENV_POLICY_FILE}: {path!r} cannot be read ({reason}); it must be a readable JSON file"
        ) from None
    return parse_policy_text(text, path), path


def prepare_metrics_dir(path: str) -> None:
    """Create the multiprocess metrics dir, writable by the engine container's user."""
    if os.path.isdir(path):
        return
    try:
        os.makedirs(path, exist_ok=True)
        os.chmod(path, 0o1777)  # shared emptyDir; the engine may run as another uid
    except OSError as exc:
        raise SettingsError(
            f"{contract.ENV_PROMETHEUS_MULTIPROC_DIR}: {path!r} cannot be created ({exc.strerror}); "
            "it must be a writable directory (the shared metrics volume)"
        ) from None


def load(env: Mapping[str, str]) -> SidecarSettings:
    """Settings from ``env`` and the policy file it names; raises ``SettingsError``."""
    spec, path = read_policy(env)
    return load_settings(env, spec, path)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dry-run", action="store_true", help="validate and print the LMCache command")
    args = parser.parse_args(argv)
    env = dict(os.environ)
    env.setdefault(contract.ENV_INSTANCE_ID, socket.gethostname())  # the pod name in Kubernetes
    try:
        settings = load(env)
    except SettingsError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG

    def command() -> ServerCommand:
        """Measured facts (free /dev/shm, the fs tier after trimming) -> the command; before each spawn."""
        capacity = None
        if settings.l2_fs is not None and settings.l2_fs.size_bytes is not None and not args.dry_run:
            capacity = trim_before_start(settings.l2_fs.path, settings.l2_fs.size_bytes)
        return build_server_command(settings, env, shm_free_bytes(settings.shm_name), fs_capacity_bytes=capacity)

    if args.dry_run:
        cmd = command()
        print(json.dumps({"argv": list(cmd.argv), "env": cmd.redacted_env_keys(), "uses_shm": cmd.uses_shm}))
        return 0

    try:
        prepare_metrics_dir(settings.metrics_dir)
    except SettingsError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    supervisor = Supervisor(settings, command)
    try:
        endpoints = start_endpoints(supervisor, settings.sidecar_http_port, settings.metrics_dir)
    except OSError as exc:
        print(
            f"{PROG}: {contract.ENV_SIDECAR_HTTP_PORT}: port {settings.sidecar_http_port} "
            f"cannot be bound ({exc.strerror}); choose a free port",
            file=sys.stderr,
        )
        return EXIT_CANNOT_START

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("event=signal_received signal=%s", signal.Signals(signum).name)
        supervisor.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("event=sidecar_starting %s", " ".join(f"{k}={v}" for k, v in settings.describe().items()))
    try:
        return supervisor.run()
    finally:
        endpoints.shutdown()


if __name__ == "__main__":
    sys.exit(main())
