"""delaymq.wheel."""
