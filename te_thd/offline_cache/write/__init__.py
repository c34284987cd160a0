"""Writing a cache: shard files, the durable writer, the producer loops, resume and the
producer. Never imports the read layer.
"""
