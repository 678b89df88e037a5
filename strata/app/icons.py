"""Tray and window icons, drawn from the SVG files in strata/resources/icons."""

from __future__ import annotations

from functools import cache
from importlib import resources

from PySide6.QtCore import QSize
from PySide6.QtGui import QIcon, QPixmap

ICON_STATES = ("serving", "busy", "released", "offloaded", "sleeping", "unloaded", "error")
# Panels ask for 16..48 px; rendering each size from the SVG keeps 16 px crisp.
_SIZES_PX = (16, 22, 24, 32, 48, 64)


def icon_path(name: str) -> str:
    """Filesystem path of an icon file (state-<name>.svg, or strata.svg for the app)."""
    file_name = "strata.svg" if name == "app" else f"state-{name}.svg"
    return str(resources.files("strata.resources") / "icons" / file_name)


@cache
def icon(name: str) -> QIcon:
    """The QIcon for a state name in ICON_STATES (or "app"); raises KeyError for others."""
    if name != "app" and name not in ICON_STATES:
        raise KeyError(f"no icon for state {name!r}; known: {', '.join(ICON_STATES)}")
    path = icon_path(name)
    result = QIcon()
    for size in _SIZES_PX:
        pixmap = QPixmap(path)
        if pixmap.isNull():
            raise FileNotFoundError(f"icon {path} could not be read; reinstall strata")
        result.addPixmap(QIcon(path).pixmap(QSize(size, size)))
    return result
