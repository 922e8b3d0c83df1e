"""hmp in the frameworks its users train with.

Each integration is its own module and imports its framework only when that
module is imported (``hmp.integrations.lightning`` needs ``lightning``).
"""
