"""The Celery settings of the pipeline's app: the top-level ``celeryconfig.py`` installed beside
this package, read from that file under a name of the pipeline's own (``tasks.config``).

Celery imports a configuration given by name (``config_from_object("celeryconfig")``) with the
working directory first on ``sys.path``, so any project's ``celeryconfig.py`` there, or one
earlier on ``PYTHONPATH``, would be read instead. ``tasks.app`` names ``tasks.config:settings``:
imported when the app's configuration is first used, so the environment of that moment
decides (docs/configuration.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).resolve().parent.parent / "celeryconfig.py"


def load(path: Path = SOURCE) -> ModuleType:
    """Run the settings file at ``path`` as a module of its own (not put in ``sys.modules``:
    it stands for no importable name)."""
    spec = importlib.util.spec_from_file_location("celeryconfig", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise ImportError(f"the pipeline's Celery settings are missing: {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


settings = load()
