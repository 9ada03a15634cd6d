"""The worker daemon (installed as axond.worker)."""
