"""Schedules of the tcp backend: functions over a `GroupView` (a framed group, its options and scratch buffers)."""
