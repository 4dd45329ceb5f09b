"""delaymq.metaserver."""
