"""The trainer: config loading, data, the training loop, checkpoints, telemetry, run safety."""
