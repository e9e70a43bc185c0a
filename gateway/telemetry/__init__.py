"""What each request leaves behind besides its log row: Prometheus metrics, traces, the access log
(sinks of its RequestRecord; trace.py is the no-op trace of tracing off)."""
