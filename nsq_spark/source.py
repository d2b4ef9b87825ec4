"""The ``nsq`` data source: what Spark calls for ``format("nsq")``."""

from __future__ import annotations

from pyspark.sql.datasource import DataSource
from pyspark.sql.types import StructType

from .batch import NSQBatchReader
from .options import OptionError, ReadOptions, WriteOptions
from .rows import SCHEMA
from .sink import NSQStreamWriter, NSQWriter, check_columns
from .stream import NSQStreamReader


class NSQDataSource(DataSource):
    """Topics of nsqd as a streaming and batch source and sink."""

    @classmethod
    def name(cls) -> str:
        return "nsq"

    def schema(self) -> StructType:
        """Spark asks this at ``load()`` (reads only): bad read options are refused here with their
        own message (raised from ``streamReader()``, PySpark 4's runner hides it behind an
        ``UnboundLocalError``)."""
        ReadOptions.parse(self.options)
        return SCHEMA

    def reader(self, schema: StructType) -> NSQBatchReader:
        _check_schema(schema)
        return NSQBatchReader(ReadOptions.parse(self.options))

    def streamReader(self, schema: StructType) -> NSQStreamReader:
        _check_schema(schema)
        return NSQStreamReader(ReadOptions.parse(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> NSQWriter:
        if overwrite:
            raise OptionError("the nsq sink publishes messages, it cannot overwrite a topic: use mode('append')")
        opts = WriteOptions.parse(self.options)
        return NSQWriter(opts, check_columns(schema, opts))

    def streamWriter(self, schema: StructType, overwrite: bool) -> NSQStreamWriter:
        opts = WriteOptions.parse(self.options)
        return NSQStreamWriter(opts, check_columns(schema, opts))


def _check_schema(schema: StructType) -> None:
    if schema.simpleString() != SCHEMA.simpleString():
        raise OptionError(f"the nsq source has a fixed schema ({SCHEMA.simpleString()}); do not set one")
