"""Waiting for state that lives in another process: no event crosses the process boundary, so poll."""

import time


def wait_for(condition, seconds: float = 10.0, every: float = 0.05, what: str = "the condition") -> None:
    """Call `condition` every `every` seconds until it holds; fail the test after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {seconds:g} s waiting for {what}"
        time.sleep(every)
