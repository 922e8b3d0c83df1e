"""The driver, on the top floor: ``convert()``/``revert()`` (conversion.py),
which install the core's wrappers and every rule, and the user-function
decorators and ``register`` (user.py)."""
