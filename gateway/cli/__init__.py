"""`python -m gateway serve | dev | db | keys | policy | route | report`."""
