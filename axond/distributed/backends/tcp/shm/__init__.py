"""Shared memory between the ranks of one host: the arena (large ops), the mailbox (small ops), their schedules."""
