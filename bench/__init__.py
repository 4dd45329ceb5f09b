"""delaymq.bench: the benchmarks ``delaymq bench`` runs, each against a baseline run in the
same invocation where one exists (a Redis sorted-set queue for the delay path).

Nothing here prints; ``delaymq.cli.bench_command`` prints the rows.
"""
