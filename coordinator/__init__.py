"""The coordinator daemon (installed as axond.coordinator)."""
