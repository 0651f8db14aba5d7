"""Where the project's files are: paths in configs are relative to the current directory, else to the project."""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def resolve_path(path: str | Path) -> Path:
    """Relative paths are taken from the current directory, else from the project root."""
    path = Path(path).expanduser()
    if path.is_absolute() or path.exists():
        return path
    return PROJECT_ROOT / path
