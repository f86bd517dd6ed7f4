"""The pipeline's Celery face — the top-level ``tasks`` package installed beside ``pipeline`` —
loaded from where it is installed, never by its bare name looked up on ``sys.path``: a user's
own ``tasks`` module or package found first (in the working directory of ``python -m``, on
``PYTHONPATH``) cannot stand in for it in a worker node or in Flower. ``tasks.app`` reads its
Celery settings the same way (``tasks/config.py``: the ``celeryconfig.py`` beside the
package, not a ``celeryconfig`` module on the path)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import ConfigError

# site-packages for an installed package, the checkout for an editable one: ``tasks/`` and
# ``celeryconfig.py`` are installed beside ``pipeline/`` (pyproject.toml)
INSTALL_ROOT = Path(__file__).resolve().parents[2]
NAME = "tasks"


def load_tasks() -> ModuleType:
    """The pipeline's ``tasks`` package (imported once, from :data:`INSTALL_ROOT`). A
    ConfigError when another module named ``tasks`` is already imported in this process, or
    the package is not installed beside ``pipeline``."""
    init = INSTALL_ROOT / NAME / "__init__.py"
    loaded = sys.modules.get(NAME)
    if loaded is not None:
        where = getattr(loaded, "__file__", None)
        if where and Path(where).resolve() == init.resolve():
            return loaded
        raise ConfigError(
            f"another module named {NAME!r} is already imported ({where or loaded!r}); the "
            f"pipeline's Celery app is {init.parent}"
        )
    if not init.is_file():
        raise ConfigError(f"the pipeline's {NAME!r} package is not installed at {init.parent}")
    spec = importlib.util.spec_from_file_location(
        NAME, init, submodule_search_locations=[str(init.parent)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for name in [n for n in sys.modules if n == NAME or n.startswith(NAME + ".")]:
            del sys.modules[name]
        raise
    return module


def run_celery(app: Any, argv: list[str]) -> int:
    """Run the ``celery`` command (``worker``, ``flower``...) on ``app``, as ``app.start`` does,
    and return its exit status, which ``app.start`` and ``app.worker_main`` drop: a node that
    stopped at start-up exits non-zero."""
    from celery.bin.celery import celery

    celery.params[0].default = app
    try:
        return int(celery.main(args=argv, standalone_mode=False) or 0)
    finally:
        celery.params[0].default = None
