"""The controller's log file handler: a line that cannot be written (the run directory's disk is full) is
dropped, with one note on stderr, instead of `logging`'s traceback per record on the console."""

from __future__ import annotations

import logging
import sys


class DroppingFileHandler(logging.FileHandler):
    """A `FileHandler` that counts its failed writes (`dropped`) instead of raising, and says so once."""

    def __init__(self, filename: str, encoding: str | None = None) -> None:
        super().__init__(filename, encoding=encoding)
        self.dropped = 0
        self._noted = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        self.dropped += 1
        self._note(sys.exc_info()[1])

    def flush(self) -> None:
        """Flush, or drop what the full disk will not take (closing flushes too, and must not raise)."""
        try:
            super().flush()
        except OSError as exc:
            self.dropped += 1
            self._note(exc)

    def close(self) -> None:
        try:
            super().close()
        except OSError as exc:  # the file object's own last flush
            self._note(exc)

    def _note(self, error: BaseException | None) -> None:
        if not self._noted:
            self._noted = True
            sys.stderr.write(f"libra: cannot write the log file {self.baseFilename} ({error}); its lines are "
                             "dropped while this lasts. Free space on that file system\n")
