"""The commands over a cache: verify, repair, plan and their CLI."""
