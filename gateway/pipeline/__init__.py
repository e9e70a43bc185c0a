"""One request's story: prepare, route, admit, send or stream with failover, account and record."""
