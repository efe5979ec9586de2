"""Who may reach the Ray head `joynexus up` starts, and where it listens (issue 41.14).

A reachable Ray cluster runs any code it is sent, so the head is started with Ray's token
authentication on (``RAY_AUTH_MODE=token``, Ray 2.52+): every gRPC and HTTP entry point of the GCS,
the raylets and the agents refuses a caller without the token. The token is made once per data dir,
``<data_dir>/run/ray_auth_token`` (64 hex characters, mode 0600), and reaches Ray through
``RAY_AUTH_TOKEN_PATH``, never through the command line or ``env.sh`` itself: `up` gives it to the
processes it starts, ``env.sh`` names the file for a shell, and `joynexus.connect` sets it for a
process that finds the deployment through the data dir.

Where the head listens is the setting ``JOYNEXUS_RAY_BIND``:

* ``127.0.0.1`` (the default): every port of the head (GCS, raylet, object manager, agents, Ray
  Client server, metrics) on loopback only. Ray itself replaces a loopback node address by the host's
  outward one and binds its gRPC servers to every interface; its single-host mode
  (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, set on both sides) keeps the node address 127.0.0.1,
  and then Ray binds everything to it. The dashboard is not started (``--include-dashboard=false``).
* an address of this host (``10.0.0.5``): other hosts may join the head or connect to it; Ray then
  listens on every interface (its own choice, not ours), and the token is what guards it.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from pathlib import Path

from joynexus.settings import Settings

__all__ = [
    "LOOPBACK",
    "TOKEN_FILE",
    "ensure_ray_token",
    "ray_access_env",
    "ray_bind_address",
]

TOKEN_FILE = "ray_auth_token"
LOOPBACK = "127.0.0.1"


def ray_bind_address(settings: Settings) -> str:
    """The address the Ray head listens on (``JOYNEXUS_RAY_BIND``), checked: an IP address of this
    host, never a wildcard (Ray needs the address other nodes reach it at)."""
    text = settings.ray_bind.strip()
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        raise ValueError(
            f"JOYNEXUS_RAY_BIND: expected an IP address (127.0.0.1, the default, or an address of this host), "
            f"got {text!r}"
        ) from None
    if address.is_unspecified:
        raise ValueError(
            f"JOYNEXUS_RAY_BIND: {text!r} is no address others reach this host at; give this host's own address "
            "(Ray then listens on every interface, token authentication on)"
        )
    return "127.0.0.1" if address.is_loopback else str(address)


def ensure_ray_token(folder: Path) -> Path:
    """This deployment's token file in ``folder`` (its run dir), made if missing: 32 random bytes
    as hex, readable by this user only. Reused by every later `up` of the data dir."""
    path = folder / TOKEN_FILE
    folder.mkdir(parents=True, exist_ok=True)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(path, 0o600)  # a copy restored with looser bits is tightened again
        if not path.read_text().strip():
            raise ValueError(f"{path}: the Ray token file is empty; remove it and run `joynexus up` again") from None
        return path
    with os.fdopen(descriptor, "w") as out:
        out.write(secrets.token_hex(32))
    return path


def ray_access_env(token_path: str | Path, bind: str) -> dict[str, str]:
    """What both sides of a connection to that head export: token mode, the token's file, and on
    loopback Ray's single-host mode (a client without it resolves 127.0.0.1 to the host's outward
    address, where nothing listens)."""
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
    if bind == LOOPBACK:
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    return env
