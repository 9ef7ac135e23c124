"""The RL library the stages compute with: models and samplers, batches, the loss, advantages,
FLOPs and checkpoint I/O. Only stage processes load it (most of it needs torch)."""
