"""nsqd topics as a PySpark source and sink (format ``nsq``).

Call :func:`register` once per SparkSession, then use
``spark.readStream.format("nsq")``, ``spark.read.format("nsq")``,
``df.writeStream.format("nsq")`` or ``df.write.format("nsq")``.
See docs/spark.md.
"""

from __future__ import annotations

from .source import NSQDataSource

__all__ = ["NSQDataSource", "register"]


def register(spark) -> None:
    """Make ``format("nsq")`` available in ``spark`` (a SparkSession)."""
    spark.dataSource.register(NSQDataSource)
