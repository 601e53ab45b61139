"""The init step of an injected pod (admission mode) that writes the engine's TensorRT-LLM options
file: the user's file, read from their ConfigMap as the engine would mount it, with kvoffload's keys
merged over it (:mod:`kvoffload.trtllm_options_merge`), into the volume the engine reads it from.

    python3 -m kvoffload.trtllm_options_init --ours JSON --out PATH [--user-file PATH [--user-digest SHA256]]

Runs with the engine's image (python3 and PyYAML are there). A user file whose digest differs from
the one the operator planned with (edited since) is merged anyway, with one line naming both: the
operator re-plans on such edits. An unreadable or unusable file: one line, exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from kvoffload.trtllm_options_merge import merge_options, options_digest, options_yaml, parse_user_options

PREFIX = "kvoffload-trtllm-options:"


def run(argv: Sequence[str]) -> int:
    """Write the merged file; the exit status (0 written, 1 not)."""
    parser = argparse.ArgumentParser(prog="python3 -m kvoffload.trtllm_options_init")
    parser.add_argument("--ours", required=True, help="kvoffload's options (JSON mapping)")
    parser.add_argument("--out", required=True, type=Path, help="the merged file to write")
    parser.add_argument("--user-file", type=Path, help="the user's options file, where there is one")
    parser.add_argument("--user-digest", help="sha256 of the user's file the operator planned with")
    args = parser.parse_args(argv)
    text = None
    if args.user_file is not None:
        try:
            text = args.user_file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            print(
                f"{PREFIX} cannot read the options file {args.user_file}: {type(exc).__name__}: {exc}", file=sys.stderr
            )
            return 1
        found = options_digest(text)
        if args.user_digest and found != args.user_digest:
            print(f"{PREFIX} {args.user_file} has sha256 {found}, the operator planned with {args.user_digest} "
                  "(edited since): merged as it is now; the operator plans again", file=sys.stderr)  # fmt: skip
    user = parse_user_options(text)
    if isinstance(user, str):
        print(f"{PREFIX} {args.user_file}: {user}", file=sys.stderr)
        return 1
    try:
        ours = json.loads(args.ours)
        merged = options_yaml(merge_options(user, ours))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        print(f"{PREFIX} --ours is not kvoffload's options: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    partial = args.out.with_name(args.out.name + ".partial")
    try:
        partial.write_text(merged)
        os.replace(partial, args.out)  # the engine never reads half a file
    except OSError as exc:
        print(f"{PREFIX} cannot write {args.out}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
