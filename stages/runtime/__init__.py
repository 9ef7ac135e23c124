"""The torch-free runtime: the run config, the data and its answers, the run directory's names and
ledger, the stage table, the stage harness, the launch environment, logs and retry policies. jobs/
imports only this."""
