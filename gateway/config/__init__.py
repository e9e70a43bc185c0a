"""Configuration: settings (the only environment reader), secrets on disk, the routing policy."""
