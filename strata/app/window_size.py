"""Initial window sizes that fit the screen the window opens on."""

from __future__ import annotations

from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QWidget

# Room for a title bar the window manager adds around the client area (Windows 11 at 150%
# draws about 45 px); availableGeometry already leaves out the taskbar.
TITLE_BAR_PX = 48


def fit_to_screen(window: QWidget, width_px: int, height_px: int) -> None:
    """Resize `window` to width x height, or less where its screen's free area is smaller
    (1280x720 at 100%, 1920x1080 at 150% both leave about 1280x680 logical pixels)."""
    screen = window.screen() or QGuiApplication.primaryScreen()
    if screen is None:  # no screen at all (offscreen tests): the asked size
        window.resize(width_px, height_px)
        return
    free = screen.availableGeometry()
    window.resize(min(width_px, free.width()), min(height_px, free.height() - TITLE_BAR_PX))
