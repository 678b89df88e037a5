"""The model library: what is on disk (catalog) and how more gets there (pull)."""
