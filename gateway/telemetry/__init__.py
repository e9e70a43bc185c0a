"""What each request leaves behind besides its log row: Prometheus metrics, traces, the access log."""
