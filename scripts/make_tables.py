"""Aggregate training runs into result tables: see `python scripts/make_tables.py --help`."""

from dpmuon.eval.cli import tables_main

if __name__ == "__main__":
    raise SystemExit(tables_main())
