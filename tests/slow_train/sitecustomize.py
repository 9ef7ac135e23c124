"""Fault injection for tests only (tests/test_faults.py): on PYTHONPATH, it makes the train process
named by SYNCRL_TEST_SLOW_TRAIN ("0:1:30" = iteration 0, rank 1, 30 s) wait that long at the start of
its updates (after its turn and its `pid=` line), in its first attempt only: long enough for a test to
inject a fault mid-train, however short the tiny model's update is.

The wait is put into stages.rl.steps.optimizer_steps, which train's updates call first, when that
module is imported (tests/injected_delay.py): train itself runs as __main__, which runpy executes
without its loader's exec_module.
"""

from tests.injected_delay import delay_train_from_env

delay_train_from_env("SYNCRL_TEST_SLOW_TRAIN", "stages.rl.steps", "optimizer_steps", "slow_train", "before the updates")
