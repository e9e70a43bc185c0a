"""The database: engine, ORM models, migrations, the request-log writer (queue, spool), reports."""
