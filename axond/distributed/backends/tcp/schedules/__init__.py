"""Schedules of the tcp backend: functions over a `Comm` (a framed group, its options and scratch buffers)."""
