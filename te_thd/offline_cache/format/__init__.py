"""The cache's on-disk format: names, dtypes and schema, the errors that name them, the
ragged token layout and its codecs, the length rule, the shard header and its checksums.

It opens no storage: what reads a shard's bytes is handed a local path.
"""
