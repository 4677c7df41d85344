"""Results: the tables sweeps append (``results``), the Parquet results store (``store``, on disk ``files``) and the
migration of result files into it (``migrate``, ``result_records``, ``migration_check``)."""
