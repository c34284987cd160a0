"""Where a cache lives: the :class:`~te_thd.offline_cache.storage.base.Storage` interface,
a local directory, and the object stores (s3://, msc://) behind it.
"""
