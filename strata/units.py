"""Byte units, one definition for every layer (torch-free, Qt-free)."""

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
