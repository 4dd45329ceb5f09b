"""The backlog job's entry for ``spark-submit`` (see submit.sh beside it).

``spark-submit ... backlog_job.py --scheduler-data hdfs:///delaymq/scheduler-1 --out hdfs:///reports``
runs ``delaymq.backlog.job.main``: the same job ``delaymq backlog`` runs on a local Spark.
"""

import sys

from delaymq.backlog.job import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
