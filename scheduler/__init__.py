"""delaymq.scheduler."""
