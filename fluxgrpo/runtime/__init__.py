"""The only package that names a device or a distributed backend (a test enforces it)."""
