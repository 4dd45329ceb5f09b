"""Network partitions of real server processes: each in a network namespace of its own, links cut by
nftables rules (``tests/support/netns.py``). The scenarios are in tests/faults/test_faults_partitions.py."""
