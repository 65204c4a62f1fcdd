"""The `kvferry` command line: `kvferry bench NAME` (one per benchmark), `kvferry formats`, `kvferry server`."""
