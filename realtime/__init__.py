"""delaymq.realtime."""
