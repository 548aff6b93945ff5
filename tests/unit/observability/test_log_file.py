"""The controller's log file on a full disk (/dev/full answers every write with ENOSPC): records are dropped
and counted, one note goes to stderr, and no `logging` traceback reaches the console."""

from __future__ import annotations

import logging

import pytest

from libra.observability.log_file import DroppingFileHandler


@pytest.mark.parametrize("records", [1, 5], ids=["one-record", "five-records"])
def test_a_full_disk_drops_log_lines_with_one_note(records: int, capsys: pytest.CaptureFixture[str]) -> None:
    handler = DroppingFileHandler("/dev/full", encoding="utf-8")
    logger = logging.getLogger(f"test-log-file-{records}")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        for i in range(records):
            logger.warning("line %d", i)
    finally:
        logger.removeHandler(handler)
        handler.close()
    err = capsys.readouterr().err
    assert handler.dropped == records + 1  # each record's write, and the last flush when closed
    assert err.count("cannot write the log file /dev/full") == 1 and "Free space" in err
    assert "Traceback" not in err and "Logging error" not in err
