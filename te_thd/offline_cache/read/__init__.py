"""Reading a cache: the open, the batch plan and its executor, ragged token reads, the
dataset, following a live producer. Never imports the write layer.
"""
