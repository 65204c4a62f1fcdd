"""What `kvferry server` and its clients both speak: the wire messages, and the framing on the server's Unix socket."""
