"""`python -m kvferry.server [flags]` runs the server (the same as `kvferry server`)."""

import sys

from kvferry.server.app import run_from_command_line

sys.exit(run_from_command_line())
