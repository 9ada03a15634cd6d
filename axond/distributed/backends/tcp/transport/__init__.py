"""The tcp transport: connection set-up (`mesh`, `handshake`), the peer that owns its socket (`peer`), framing and
its checks (`framing`, `exchange`), the wire format (`wire`)."""
