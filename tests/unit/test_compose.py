"""docker-compose.yml and the Dockerfile match the package, without Docker: every command run
in the project's own image is a console script of pyproject.toml (parsed with the CLI's own
argparse parser, so a renamed subcommand or flag fails here) or ``celery``; the Dockerfile
copies files that exist and everything ``pip install .`` needs; the ``./`` bind mounts exist."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
PYPROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]


def argv_of(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(a) for a in value]


def own_image(service: dict[str, Any]) -> bool:
    build = service.get("build")
    context = build.get("context", ".") if isinstance(build, dict) else build
    return context is not None and (ROOT / context).resolve() == ROOT


def dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (INSTRUCTION, rest of the line)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [
        (word.upper(), rest.strip())
        for word, _, rest in (line.partition(" ") for line in lines)
        if word and not word.startswith("#")
    ]


def exec_args(rest: str) -> list[str]:
    """An instruction's arguments in exec form (JSON) or shell form."""
    return json.loads(rest) if rest.startswith("[") else shlex.split(rest)


def commands() -> dict[str, list[str]]:
    """What the project's image runs: its CMD, and each own-image service's command."""
    cmd = [argv_of(exec_args(rest)) for word, rest in dockerfile() if word == "CMD"]
    found = {"Dockerfile CMD": cmd[-1]} if cmd else {}
    for name, service in COMPOSE["services"].items():
        if own_image(service) and "command" in service:
            found[name] = argv_of(service.get("entrypoint")) + argv_of(service["command"])
    return found


def parser_of(script: str) -> argparse.ArgumentParser:
    """The argparse parser behind the console script ``script``: the ``build_parser`` of the
    module that defines the entry point's function (a package may re-export only the function)."""
    module, _, attr = SCRIPTS[script].partition(":")
    func = getattr(importlib.import_module(module), attr)
    parser: argparse.ArgumentParser = sys.modules[func.__module__].build_parser()
    return parser


def remainders(parser: argparse.ArgumentParser, command: str) -> list[str]:
    """The dests of ``command``'s REMAINDER arguments (passed on to celery or flower)."""
    (subs,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [a.dest for a in subs.choices[command]._actions if a.nargs == argparse.REMAINDER]


def copy_sources() -> list[str]:
    """The build-context paths the Dockerfile's COPY and ADD take (not from another stage)."""
    sources: list[str] = []
    for word, rest in dockerfile():
        args = exec_args(rest) if word in ("COPY", "ADD") else []
        if not any(a.startswith("--from") for a in args):
            sources += [a for a in args if not a.startswith("--")][:-1]
    return [src for src in sources if "://" not in src]


def test_the_image_runs_the_pipeline() -> None:
    assert {"Dockerfile CMD", "worker", "flower"} <= set(commands())


@pytest.mark.parametrize("name", sorted(commands()))
def test_command_is_accepted_by_the_cli(name: str) -> None:
    program, *args = commands()[name]
    if program == "celery":
        # click rejects an unknown command or option even with --help (values are not checked)
        celery = Path(sys.executable).parent / "celery"
        proc = subprocess.run(
            [str(celery), *args, "--help"], capture_output=True, text=True, timeout=30
        )
        assert proc.returncode == 0, f"{name}: {shlex.join([program, *args])}\n{proc.stderr}"
        return
    assert program in SCRIPTS, f"{name}: {program!r} is neither celery nor one of {SCRIPTS}"
    parser, err, ns = parser_of(program), io.StringIO(), None
    with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        ns = parser.parse_args(args)
    assert ns is not None, f"{name}: {shlex.join([program, *args])}\n{err.getvalue()}"
    # what a REMAINDER passes on is either nothing or after a `--`, not a stray value or flag
    for dest in remainders(parser, args[0]):
        rest = getattr(ns, dest)
        assert not rest or rest[0] == "--", f"{name}: {rest} not taken by {program} {args[0]}"


def test_dockerfile_copies_what_exists() -> None:
    for src in copy_sources():
        found = (ROOT / src).exists() or any(ROOT.glob(src))  # a path or a wildcard
        assert found, f"Dockerfile: COPY {src}: not in the repository"


def test_dockerfile_copies_what_pip_install_needs() -> None:
    copied = {(Path(src).parts or (".",))[0] for src in copy_sources()}
    if "." in copied:
        return  # COPY . .
    setuptools = PYPROJECT["tool"]["setuptools"]
    readme = PYPROJECT["project"].get("readme", "README.md")
    needed = {"pyproject.toml", readme["file"] if isinstance(readme, dict) else readme}
    needed |= {f"{m}.py" for m in setuptools.get("py-modules", [])}
    needed |= {p.split(".")[0].rstrip("*") for p in setuptools["packages"]["find"]["include"]}
    assert needed <= copied, f"the Dockerfile does not copy {sorted(needed - copied)}"


def test_bind_mounts_exist() -> None:
    for name, service in COMPOSE["services"].items():
        for volume in service.get("volumes", []):
            source = volume.get("source", "") if isinstance(volume, dict) else volume.split(":")[0]
            if source.startswith("./") or source.startswith("../"):
                assert (ROOT / source).exists(), f"{name}: volume {source} does not exist"
