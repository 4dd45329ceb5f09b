"""delaymq.backlog."""
