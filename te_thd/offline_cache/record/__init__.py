"""What a cache records about itself: the manifest, the run that wrote it, and the check of
the shard files a manifest lists.
"""
