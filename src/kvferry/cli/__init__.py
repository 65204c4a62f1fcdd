"""The `kvferry` command line: `kvferry bench transfer`, `kvferry formats`, `kvferry server`."""
