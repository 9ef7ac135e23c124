# The `slurm_cluster` fixture (a real 2-node SLURM cluster on this machine) for tests marked `slurm`.
pytest_plugins = ["tests.slurm_fixture"]
