"""Fault injection for tests only (tests/test_deferred_checkpoint.py): on PYTHONPATH, it makes the
train process named by SYNCRL_TEST_SLOW_WRITE ("0:1:30" = iteration 0, rank 1, 30 s) wait that long
before it writes the checkpoint it holds after its marker (tuning.deferred_checkpoint), in its first
attempt only: long enough for the test to kill it mid-write.

The wait is put into stages.rl.deferred_checkpoint.DeferredWrites.flush when that module is imported
(tests/injected_delay.py).
"""

from tests.injected_delay import delay_train_from_env

delay_train_from_env("SYNCRL_TEST_SLOW_WRITE", "stages.rl.deferred_checkpoint", "DeferredWrites.flush", "slow_write", "before the deferred write")
