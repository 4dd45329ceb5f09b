"""``python -m delaymq.cli`` runs the ``delaymq`` command."""

from delaymq.cli.main import entry

entry()
