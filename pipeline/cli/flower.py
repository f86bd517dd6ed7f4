"""Where ``pipeline flower`` will listen, resolved as Flower itself resolves it — ``FLOWER_*``
environment variables, then its config file (``--conf``, default ``flowerconfig.py``), then
the command line, the last one winning — so that the refusal to listen beyond loopback without
authentication holds however the address is given."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class FlowerPlace:
    address: str  # "" is Flower's default: every interface
    port: int
    unix_socket: str = ""
    authenticated: bool = False  # basic auth or an OAuth provider

    @property
    def local(self) -> bool:
        """Reachable from this host only: a Unix socket or a loopback address."""
        return bool(self.unix_socket) or is_loopback(self.address)

    def at(self, address: str) -> FlowerPlace:
        return replace(self, address=address)


def is_loopback(address: str) -> bool:
    if address.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def joined(argv: list[str]) -> list[str]:
    """Flower's options as ``--name=value``: Flower (tornado) takes no ``--name value``
    pair — it drops the value and stops on the bare name — so a pair is joined first."""
    from flower.command import is_flower_option
    from tornado.options import options

    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.lstrip("-").replace("-", "_")
        takes_value = (
            arg.startswith("--")
            and "=" not in arg
            and is_flower_option(arg)
            and options._options[name.replace("_", "-")].type is not bool
        )
        if takes_value and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def effective_options(argv: list[str]) -> FlowerPlace:
    """Where Flower started with ``argv`` (its own options, after ``flower``) will listen and
    whether it asks for a login. ValueError naming the fault when Flower could not start with
    them (an unknown option, an option without its value, a missing ``--conf`` file)."""
    from flower import command
    from tornado.options import Error, options

    try:
        command.apply_env_options()
        command.apply_options("flower", argv)
    except (Error, OSError, ValueError, KeyError) as exc:
        raise ValueError(f"Flower's options: {exc}") from None
    return FlowerPlace(
        address=str(options.address or ""),
        port=int(options.port),
        unix_socket=str(options.unix_socket or ""),
        authenticated=bool(options.basic_auth) or bool(options.auth),
    )
