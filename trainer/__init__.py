"""The production trainer: one entry point, trainer/train.py, for the strategies the lessons teach (README.md)."""
