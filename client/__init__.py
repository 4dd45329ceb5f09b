"""delaymq.client."""
