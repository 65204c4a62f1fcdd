"""Serving-engine integrations: each subpackage plugs kvferry into one engine through that engine's own API."""
