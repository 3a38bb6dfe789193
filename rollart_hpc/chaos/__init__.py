"""Chaos trials against the automatic recovery of local runs (`trials`; the command is `launch.py chaos`)."""
