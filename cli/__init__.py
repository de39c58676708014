"""The kvz command line."""
