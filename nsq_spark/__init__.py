"""nsqd topics as a PySpark source and sink (format ``nsq``).

Call :func:`register` once per SparkSession, then use
``spark.readStream.format("nsq")``, ``spark.read.format("nsq")``,
``df.writeStream.format("nsq")`` or ``df.write.format("nsq")``.
See docs/spark.md.
"""

from __future__ import annotations

from . import settle
from .source import NSQDataSource

__all__ = ["NSQDataSource", "register"]


def register(spark) -> None:
    """Make ``format("nsq")`` available in ``spark`` (a SparkSession).

    Also adds the streaming listener that finishes the last batch of a query
    when it ends (see :mod:`nsq_spark.settle`).
    """
    spark.dataSource.register(NSQDataSource)
    settle.install(spark)
