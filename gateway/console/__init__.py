"""The web console at /ui for ops and finance: overview, keys, spend, routing, requests.

Served by the gateway itself from server-rendered pages (templates/, static/: no build step, no
third-party script). Behind the master key: a login form trades it for a signed, expiring,
HttpOnly SameSite=Strict session cookie (session.py), and every change carries a CSRF token.
"""
