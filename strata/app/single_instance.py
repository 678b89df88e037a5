"""One tray per user: a second launch asks the first to show its dashboard, then exits."""

from __future__ import annotations

import getpass
import hashlib

from PySide6.QtCore import QObject, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket

SHOW_DASHBOARD = b"show-dashboard\n"


def server_name(config_key: str = "") -> str:
    """The local socket name: per user (and per config file, so test runs do not collide)."""
    digest = hashlib.sha1(f"{getpass.getuser()}|{config_key}".encode()).hexdigest()[:12]
    return f"strata-tray-{digest}"


def ask_running_instance(name: str, timeout_ms: int = 1000) -> bool:
    """True when another instance listens on name and took the show-dashboard request."""
    socket = QLocalSocket()
    socket.connectToServer(name)
    if not socket.waitForConnected(timeout_ms):
        return False
    socket.write(SHOW_DASHBOARD)
    socket.flush()
    socket.waitForBytesWritten(timeout_ms)
    socket.disconnectFromServer()
    return True


class SingleInstance(QObject):
    """Listens on the per-user name; emits show_requested when a second launch knocks."""

    show_requested = Signal()

    def __init__(self, name: str, parent: QObject | None = None):
        super().__init__(parent)
        self.name = name
        self.server = QLocalServer(self)
        self.server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
        self.server.newConnection.connect(self._accept)

    def listen(self) -> bool:
        """Claim the name; a stale socket file left by a crash is removed first."""
        if self.server.listen(self.name):
            return True
        QLocalServer.removeServer(self.name)  # only reached when nobody answered on it
        return self.server.listen(self.name)

    def _accept(self) -> None:
        while self.server.hasPendingConnections():
            socket = self.server.nextPendingConnection()
            # The message may already be here, or arrive later: wait briefly, read once.
            is_ready = socket.bytesAvailable() or socket.waitForReadyRead(1000)
            if is_ready and bytes(socket.readAll().data()).startswith(SHOW_DASHBOARD.strip()):
                self.show_requested.emit()
            socket.disconnectFromServer()
            socket.deleteLater()

    def close(self) -> None:
        """Stop listening (the tray calls this as it quits)."""
        self.server.close()
