#!/usr/bin/env python
"""Fetch the raw E2E and DART files into data/raw/ (or --root), or link a local copy.

    python scripts/download_data.py                       # download (needs internet)
    python scripts/download_data.py --link /path/to/data   # use a local copy instead

The logic lives in `dpmuon.data.download` so it is importable and tested.
"""

import sys

from dpmuon.data.download import main

if __name__ == "__main__":
    sys.exit(main())
