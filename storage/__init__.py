"""delaymq.storage."""
