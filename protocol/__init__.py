"""delaymq.protocol."""
