"""HTTP routes: they only translate between schemas and services."""
