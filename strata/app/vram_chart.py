"""A stacked area chart of memory over the last minutes, painted with QPainter.

QtCharts is not in PySide6-Essentials; a few polygons are all this needs.
"""

from __future__ import annotations

import time
from collections import deque

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QPainter, QPen, QPolygonF
from PySide6.QtWidgets import QSizePolicy, QWidget

from strata.units import GIB


class StackedChart(QWidget):
    """Series stack bottom-up in the order given; samples older than window_s scroll away."""

    def __init__(self, series: list[tuple[str, str]], window_s: float = 600.0, parent=None):
        super().__init__(parent)
        self.window_s = window_s
        self.samples: deque[tuple[float, tuple[int, ...]]] = deque()
        self.set_series(series)
        self.setMinimumSize(360, 160)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)

    def set_series(self, series: list[tuple[str, str]]) -> None:
        """(name, colour) pairs, bottom first; changing them clears the history."""
        self.series = list(series)
        self.samples.clear()
        self.update()

    def add_sample(self, values_bytes: tuple[int, ...], at_s: float | None = None) -> None:
        """One reading, a byte count per series."""
        if len(values_bytes) != len(self.series):
            raise ValueError(f"chart has {len(self.series)} series, got {len(values_bytes)} values")
        now_s = time.monotonic() if at_s is None else at_s
        self.samples.append((now_s, tuple(max(0, int(v)) for v in values_bytes)))
        while self.samples and self.samples[0][0] < now_s - self.window_s:
            self.samples.popleft()
        self.update()

    def paintEvent(self, event) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        legend_h = 18
        plot = QRectF(48, 6, self.width() - 56, self.height() - 12 - legend_h)
        painter.fillRect(plot, QColor("#1e1e1e"))
        if self.samples:
            self._paint_areas(painter, plot)
        painter.setPen(QPen(self.palette().windowText().color()))
        top_bytes = self._top_bytes()
        painter.drawText(
            QRectF(0, plot.top() - 2, 44, 16),
            Qt.AlignmentFlag.AlignRight,
            f"{top_bytes / GIB:.0f} GiB" if top_bytes >= 10 * GIB else f"{top_bytes / GIB:.1f} GiB",
        )
        painter.drawText(QRectF(0, plot.bottom() - 14, 44, 16), Qt.AlignmentFlag.AlignRight, "0")
        painter.drawText(
            QRectF(plot.left(), plot.bottom() + 1, 120, 16),
            Qt.AlignmentFlag.AlignLeft,
            f"−{self.window_s / 60:.0f} min",
        )
        x = plot.left() + 130
        for name, colour in reversed(self.series):
            painter.fillRect(QRectF(x, plot.bottom() + 5, 10, 10), QColor(colour))
            painter.drawText(
                QRectF(x + 14, plot.bottom() + 1, 110, 16), Qt.AlignmentFlag.AlignLeft, name
            )
            x += 18 + painter.fontMetrics().horizontalAdvance(name) + 10
        painter.end()

    def _top_bytes(self) -> int:
        return max((sum(v) for _, v in self.samples), default=GIB) or GIB

    def _paint_areas(self, painter: QPainter, plot: QRectF) -> None:
        end_s = self.samples[-1][0]
        top = self._top_bytes()

        def point(at_s: float, level_bytes: int) -> QPointF:
            x = plot.right() - (end_s - at_s) / self.window_s * plot.width()
            return QPointF(max(plot.left(), x), plot.bottom() - level_bytes / top * plot.height())

        below = [0] * len(self.samples)
        for index, (_, colour) in enumerate(self.series):
            above = [b + values[index] for b, (_, values) in zip(below, self.samples)]
            upper = [point(t, a) for (t, _), a in zip(self.samples, above)]
            lower = [point(t, b) for (t, _), b in zip(self.samples, below)]
            if len(upper) == 1:  # one sample: draw it as a thin bar so the chart is not empty
                upper.insert(0, QPointF(upper[0].x() - 2, upper[0].y()))
                lower.insert(0, QPointF(lower[0].x() - 2, lower[0].y()))
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(QColor(colour))
            painter.drawPolygon(QPolygonF(upper + lower[::-1]))
            below = above
