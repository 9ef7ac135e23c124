"""SIGTERM stops the coordinator wherever it lands. The sbatch script's USR2 trap (and scancel) send
it; raised inside logging it would leave logging's lock held (every thread that logs then hangs,
the W&B client's at exit among them) or be swallowed in a weakref callback, so there it is raised
again once logging is done."""

import logging
import os
import signal
import threading
import time

import pytest

from jobs import coordinator


@pytest.fixture
def sigterm_handler():
    previous = signal.signal(signal.SIGTERM, coordinator._terminate)
    yield
    signal.signal(signal.SIGTERM, previous)
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)


def test_outside_logging_it_unwinds_at_once(sigterm_handler):
    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)


def test_inside_logging_it_unwinds_once_logging_is_done(sigterm_handler):
    class TermWhileEmitting(logging.Handler):
        def emit(self, record):
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(10**5))  # the handler runs here, inside logging's call with its locks held

    log = logging.getLogger("syncrl.test.signal")
    log.addHandler(TermWhileEmitting())
    log.propagate = False
    reached = []
    try:
        with pytest.raises(KeyboardInterrupt, match="signal 15"):
            log.warning("the log call returns")
            reached.append("after the log call")
            time.sleep(5)  # the deferred interrupt lands here
    finally:
        log.handlers.clear()
    assert reached == ["after the log call"]
    # logging's locks are free: another thread logs and ends.
    other = threading.Thread(target=lambda: logging.getLogger("syncrl.test.other").warning("still logs"))
    other.start()
    other.join(timeout=5)
    assert not other.is_alive()
