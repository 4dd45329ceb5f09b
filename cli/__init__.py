"""delaymq.cli."""
