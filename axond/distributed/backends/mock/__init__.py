"""The mock backend: the members of a group are threads of one process meeting in a shared hub; no socket.

    backend.py   `MockBackend`: each collective posted to the hub, checked as tcp checks frame headers, and
                 computed from the members' copies in tcp's order
    hub.py       `Hub`: where the members meet, one slot per collective and one queue per pair of members
"""

from axond.distributed.backends.mock.backend import BACKEND, MockBackend

__all__ = ["BACKEND", "MockBackend"]
