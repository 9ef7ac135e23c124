"""Every retry policy in one place, each saying what it retries and why. Torch-free."""

from __future__ import annotations

import logging

import tenacity

log = logging.getLogger("syncrl.retry")


def until_empty(max_wait_s: float, interval_s: float = 0.2) -> tenacity.Retrying:
    """Re-evaluate a check that returns the set of things still missing, until it is empty or time is up.

    For markers of ranks that exited 0: on a shared filesystem another node's file can take a moment
    to appear. Returns the last result instead of raising, so the caller names what is missing.
    """
    return tenacity.Retrying(
        stop=tenacity.stop_after_delay(max_wait_s),
        wait=tenacity.wait_fixed(interval_s),
        retry=tenacity.retry_if_result(bool),
        retry_error_callback=lambda state: state.outcome.result(),
    )


def stage_attempts(attempts: int, backoff_s: float, max_backoff_s: float, retry_on: type[BaseException],
                   describe) -> tenacity.Retrying:
    """Relaunch a failed stage attempt, with exponential backoff (a node may need time to recover).

    `describe(attempt_number, exception)` gives the warning logged before each retry.
    """
    return tenacity.Retrying(
        stop=tenacity.stop_after_attempt(attempts),
        wait=tenacity.wait_exponential(multiplier=backoff_s, max=max_backoff_s),
        retry=tenacity.retry_if_exception_type(retry_on),
        reraise=True,
        before_sleep=lambda state: log.warning(describe(state.attempt_number, state.outcome.exception())),
    )
