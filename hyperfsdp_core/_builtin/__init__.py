"""Plugins that ship with the core and are always registered."""
