"""The trainer's process: its errors, signals, multi-host job and argument helpers."""
