"""The `ray job submit` line that runs a recipe on a Ray cluster that already runs, with token authentication."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from pathlib import Path

from draftopd.cluster.layout import Layout, entrypoint


def submit_command(
    layout: Layout,
    address: str,
    runs_dir: str | None = None,
    overrides: list[str] | None = None,
    env: Mapping[str, str] = os.environ,
) -> str:
    """`ray job submit` of the recipe from a checkout (the working directory travels with the job), to a cluster
    with Ray's token authentication on. Ray's CLI reads the token from $RAY_AUTH_TOKEN, else from the file
    $RAY_AUTH_TOKEN_PATH, else from ~/.ray/auth_token: the line names that file when there is one, never the token."""
    job = shlex.split(entrypoint(layout, runs_dir, overrides))
    auth = "RAY_AUTH_MODE=token "  # without it the CLI sends no token
    if env.get("RAY_AUTH_TOKEN_PATH") and not env.get("RAY_AUTH_TOKEN"):
        path = Path(env["RAY_AUTH_TOKEN_PATH"]).expanduser().resolve()
        auth += f"RAY_AUTH_TOKEN_PATH={shlex.quote(str(path))} "  # quoted after the `=`, so it stays an assignment
    return auth + shlex.join(["ray", "job", "submit", "--address", address, "--working-dir", ".", "--", *job])


def token_source(env: Mapping[str, str] = os.environ) -> str | None:
    """Where Ray's CLI will find the token, in its order, or None when it finds none."""
    if env.get("RAY_AUTH_TOKEN"):
        return "$RAY_AUTH_TOKEN"
    if env.get("RAY_AUTH_TOKEN_PATH"):
        return f"the file $RAY_AUTH_TOKEN_PATH ({env['RAY_AUTH_TOKEN_PATH']})"
    default = Path("~/.ray/auth_token")
    return str(default) if default.expanduser().is_file() else None
