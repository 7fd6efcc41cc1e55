"""Empirical privacy audit (canaries → a lower bound on ε): see `python scripts/audit_privacy.py --help`."""

from dpmuon.audit.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
