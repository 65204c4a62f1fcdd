"""`python3 -m kvferry.cli ...`: the `kvferry` command without installing (e.g. `PYTHONPATH=src`)."""

import sys

from kvferry.cli.main import main

sys.exit(main())
