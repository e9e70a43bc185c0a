"""The database: engine, ORM models, migrations, the request record and its log writer (queue,
spool), reports."""
