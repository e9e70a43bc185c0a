"""Which model serves a request: the router, the complexity scorer, its features, its training and data."""
