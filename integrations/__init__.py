"""Bridges between kvz and real model runtimes (optional ``model`` extra)."""
