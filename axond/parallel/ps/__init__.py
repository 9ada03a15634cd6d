"""Parameter-server training: server ranks hold parameter shards and apply updates, workers push gradients."""

from axond.parallel.ps.server import ParameterServer, PSMode

__all__ = ["PSMode", "ParameterServer"]
