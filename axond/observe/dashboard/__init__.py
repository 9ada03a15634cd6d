"""The coordinator's dashboard: a web page at / of its metrics port (`pages`), fed by a JSON view of its state
(`view`); plain HTML and a small vanilla JS file served from this package, no build step, nothing fetched from the
network."""
