"""Every private torch name hmp reaches, in one module.

torch's private names change between releases without notice; keeping them
here means one file to read when a new release breaks something, and
tests/unit/test_structure.py fails if another module reaches one directly.
"""
