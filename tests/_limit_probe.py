"""Run by tests/test_harness.py with a 2-second limit: a test that hangs."""

import time


def test_hangs() -> None:
    time.sleep(60)
