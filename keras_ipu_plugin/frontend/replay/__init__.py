"""Trace each kind of block once and replay it over the others (block signatures,
call templates)."""
