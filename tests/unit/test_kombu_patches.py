"""kombu is patched (tasks/compat.py) by a worker node as it starts, never by ``import tasks``:
a client, ``pipeline serve`` or Flower imports the app and keeps kombu as shipped. A kombu
outside the range pyproject.toml pins stops the node, naming tasks/compat.py. Each case runs
in a fresh interpreter (the patches are process-wide)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]

SHIPPED = """
import kombu.transport.redis as r, kombu.transport.virtual as v
from tasks import compat
def shipped():
    names = [r.Channel._create_client, r.Channel._brpop_start, r.Channel._brpop_read,
             r.Channel._poll_error, v.Channel.basic_consume]
    return not compat.installed() and all(f.__module__.startswith("kombu.") for f in names)
"""


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SHIPPED) + textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PIPELINE_REDIS_URL": "redis://127.0.0.1:1/0"},
    )


def test_importing_the_app_as_a_client_or_flower_does_not_patch_kombu() -> None:
    done = run(
        """
        import tasks, tasks.node, tasks.inference
        import pipeline.cli.main, pipeline.cli.flower, pipeline.serve.app
        import flower.command
        assert shipped(), "kombu patched by an import"
        print("shipped")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["shipped"]


def test_a_worker_node_patches_kombu_as_it_starts() -> None:
    done = run(
        """
        import tasks
        from celery.signals import worker_init
        assert shipped()
        worker_init.send(sender=None)  # WorkController.__init__, before the broker or the pool
        assert not shipped() and compat.installed()
        worker_init.send(sender=None)  # once only
        import kombu.transport.redis as r
        assert r.Channel._create_client is compat._guarded_create_client
        print("patched")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["patched"]


def test_a_kombu_outside_the_pinned_range_stops_the_node_naming_compat() -> None:
    done = run(
        """
        import logging, sys, kombu, tasks
        from celery.signals import worker_init
        logging.basicConfig(stream=sys.stderr)
        kombu.__version__ = "5.8.0"
        worker_init.send(sender=None)
        """
    )
    assert done.returncode == 3  # tasks.node.EXIT_STARTUP_FAILED
    assert "kombu 5.8.0 is installed" in done.stderr
    assert "tasks/compat.py" in done.stderr


@pytest.mark.parametrize(
    ("version", "fits"), [("5.7.0", True), ("5.7.9", True), ("5.8.0", False), ("5.6.4", False)]
)
def test_the_version_check_reads_the_pin_of_pyproject_toml(version: str, fits: bool) -> None:
    from tasks import compat

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [str(r.specifier) for r in map(Requirement, deps) if r.name == "kombu"]
    assert compat.pinned_kombu() == pin  # the installed metadata is pyproject.toml's
    if fits:
        compat.check_kombu(version)
    else:
        with pytest.raises(compat.UnsupportedKombu, match="tasks/compat.py"):
            compat.check_kombu(version)
